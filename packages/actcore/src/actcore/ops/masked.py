"""Reference masked ops: quantize only the elements a packed 1-bit mask selects, and back.

A tensor whose zeros are exactly a known mask's zeros (a ReLU output next to the ReLU's own
mask) is stored as its selected values only (AC-GC's zero-value compression). The native
kernels read the mask's bits instead of searching the tensor for nonzeros; these references
say what they compute, in the simplest terms:

* ``masked_quantize(x, mask, ...)`` is ``quantize`` of ``x.reshape(-1)[mask]`` (row-major
  order) as one row (``per_sample=False``): the same payload, ``lo`` and ``step``, the
  rounding noise of each value that of its rank among the selected ones;
* ``masked_dequantize(...)`` is a tensor of zeros (+0) with those values put back in order;
* ``apply_mask(x, mask)`` is ``torch.where(mask, x, 0)`` (a ReLU's input gradient from its
  mask), contiguous.

The mask is ``pack_mask``'s layout, ``ceil(numel / 8)`` bytes at least; bits past ``numel``
are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .bitpack import unpack_bits_reference
from .quantization import dequantize_reference, quantize_reference

__all__ = ["apply_mask_reference", "masked_dequantize_reference", "masked_quantize_reference"]


def _keep(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of a packed mask as a flat bool tensor."""
    return unpack_bits_reference(mask.reshape(-1), 1, numel).view(torch.bool)


def masked_quantize_reference(
    x: torch.Tensor, mask: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = x.reshape(-1)[_keep(mask, x.numel())]
    return quantize_reference(values, bits, group_size, stochastic, seed, False)


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
    values = dequantize_reference(payload, lo, step, bits, group_size, [count], dtype, False)
    out = torch.zeros(numel, dtype=dtype, device=payload.device)
    out[keep] = values
    return out.view(tuple(shape))


def apply_mask_reference(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = _keep(mask, x.numel()).view(x.shape)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).contiguous()
