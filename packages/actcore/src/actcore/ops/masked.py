"""Reference masked ops: quantize only the elements a packed 1-bit mask selects, and back.

A tensor whose zeros are exactly a known mask's zeros (a ReLU output next to the ReLU's own
mask) is stored as its selected values only (AC-GC's zero-value compression). The native
kernels read the mask's bits instead of searching the tensor for nonzeros; these references
say what they compute, in the simplest terms:

* ``masked_quantize(x, mask, ...)`` is ``quantize`` of ``x.reshape(-1)[mask]`` (row-major
  order) as one row (``per_sample=False``): the same payload, ``lo`` and ``step``, the
  rounding noise of each value that of its rank among the selected ones;
* ``masked_quantize_padded(x, mask, ...)`` is the same in buffers sized for every element of
  ``x`` (zero past the values), plus the count of selected elements as a 0-d int64 tensor:
  a CUDA kernel makes it without waiting for the count to reach the host;
* ``masked_dequantize(...)`` is a tensor of zeros (+0) with those values put back in order
  (from either op's buffers: what lies past the count is never read);
* ``apply_mask(x, mask)`` is ``torch.where(mask, x, 0)`` (a ReLU's input gradient from its
  mask), contiguous.

The mask is ``pack_mask``'s layout, ``ceil(numel / 8)`` bytes at least; bits past ``numel``
are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .bitpack import packed_nbytes, unpack_bits_reference
from .quantization import dequantize_reference, quantize_reference

__all__ = [
    "apply_mask_reference",
    "kept_floor",
    "masked_dequantize_reference",
    "masked_quantize_padded_reference",
    "masked_quantize_reference",
]

# Products of a value at least this with gradients of magnitude 2**-66 and more stay normal
# float32 / bfloat16 numbers (subnormal operands made a convolution's backward up to 3x slower)
_KEPT_FLOOR = 2.0**-60


def kept_floor(dtype: torch.dtype) -> float:
    """The least value a restored ReLU output keeps where its mask is set: positive, so the
    ReLU's own backward (``threshold_backward``, which tests ``> 0``) passes the gradient
    there, and far enough above the subnormals that the products backward forms with it
    (a convolution's or a matrix product's weight gradient) stay normal numbers, which
    CPUs compute at full speed. Moves a kept value that restored to 0 by at most
    ``2**-60`` (``dtype``'s smallest normal where that is larger: float16's ``2**-14``)."""
    return max(torch.finfo(dtype).tiny, _KEPT_FLOOR)


def _keep(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of a packed mask as a flat bool tensor."""
    return unpack_bits_reference(mask.reshape(-1), 1, numel).view(torch.bool)


def masked_quantize_reference(
    x: torch.Tensor, mask: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = x.reshape(-1)[_keep(mask, x.numel())]
    return quantize_reference(values, bits, group_size, stochastic, seed, False)


def masked_quantize_padded_reference(
    x: torch.Tensor, mask: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    numel = x.numel()
    payload, lo, step = masked_quantize_reference(x, mask, bits, group_size, stochastic, seed)
    groups = -(-numel // group_size)
    widths = (packed_nbytes(numel, bits), groups, groups)
    padded = [
        torch.nn.functional.pad(t, (0, w - t.shape[1]))
        for t, w in zip((payload, lo, step), widths, strict=True)
    ]
    count = _keep(mask, numel).sum() if numel else torch.zeros((), dtype=torch.int64)
    return (*padded, count.to(device=x.device, dtype=torch.int64))


def masked_dequantize_reference(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    group_size: int,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    numel = math.prod(shape)
    keep = _keep(mask, numel)
    count = int(keep.sum())
    groups = -(-count // group_size)  # masked_quantize_padded's buffers hold more: cut them
    payload, lo, step = payload[:, : packed_nbytes(count, bits)], lo[:, :groups], step[:, :groups]
    values = dequantize_reference(payload, lo, step, bits, group_size, [count], dtype, False)
    out = torch.zeros(numel, dtype=dtype, device=payload.device)
    out[keep] = values
    return out.view(tuple(shape))


def apply_mask_reference(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = _keep(mask, x.numel()).view(x.shape)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).contiguous()
