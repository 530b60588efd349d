"""The ``actcore::*`` operators, declared once with :mod:`torch.library`.

Each op has a schema, a fake (meta) kernel so ``torch.compile`` and FakeTensor tracing see
its output shapes, and the pure-PyTorch reference as the implementation for every device.
Native kernels (``csrc/``: CUDA, and C++ for CPU) register themselves for their device on
top of these: the first call on a tensor of that device loads them
(:mod:`actcore.native.loader`) and hands over.
The ops take already-validated arguments; :mod:`actcore.ops.api` is the checked front end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..native import loader as _native
from .bitpack import pack_bits_reference, packed_nbytes, unpack_bits_reference
from .masked import (
    apply_mask_reference,
    masked_dequantize_reference,
    masked_quantize_padded_reference,
    masked_quantize_reference,
)
from .noise import uniform_noise
from .quantization import (
    META_DTYPE,
    dequantize_reference,
    quantize_reference,
    rows_and_cols,
)

__all__ = [
    "apply_mask",
    "channel_multiplied",
    "dequantize",
    "dequantize_scaled",
    "hash_uniform",
    "masked_dequantize",
    "masked_quantize",
    "masked_quantize_padded",
    "pack_bits",
    "quantize",
    "quantize_scaled",
    "relu_mask",
    "unpack_bits",
]

_Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _dispatch(name: str, on: torch.Tensor, reference: Callable[..., Any], *args: Any) -> Any:
    """The native ``name`` kernel for ``on``'s device when it is built and loaded (the first
    call on a device loads its kernels), else ``reference(*args)``."""
    if on.is_cuda and _native.ready(name):
        return _native.call(name, *args)
    if on.device.type == "cpu" and _native.cpu_ready(name):
        return _native.call(name, *args)
    return reference(*args)


@torch.library.custom_op("actcore::quantize", mutates_args=())
def quantize(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, per_sample: bool
) -> _Tensors3:
    """Per-group k-bit quantization: returns (payload uint8, lo bf16, step bf16)."""
    args = (x, bits, group_size, stochastic, seed, per_sample)
    return _dispatch("quantize", x, quantize_reference, *args)


@quantize.register_fake
def quantize_fake(x, bits, group_size, stochastic, seed, per_sample) -> _Tensors3:
    """The fake of ``actcore::quantize`` (and of the ops that quantize as it does)."""
    rows, cols = rows_and_cols(x.shape, per_sample)
    payload = x.new_empty((rows, packed_nbytes(cols, bits)), dtype=torch.uint8)
    groups = (cols + group_size - 1) // group_size
    lo = x.new_empty((rows, groups), dtype=META_DTYPE)
    return payload, lo, torch.empty_like(lo)


@torch.library.custom_op("actcore::dequantize", mutates_args=())
def dequantize(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group_size: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    per_sample: bool,
) -> torch.Tensor:
    """Inverse of ``quantize``: a tensor of ``shape`` and ``dtype`` on the payload's device."""
    args = (payload, lo, step, bits, group_size, shape, dtype, per_sample)
    return _dispatch("dequantize", payload, dequantize_reference, *args)


@dequantize.register_fake
def _dequantize_fake(payload, lo, step, bits, group_size, shape, dtype, per_sample):
    return payload.new_empty(tuple(shape), dtype=dtype)


def channel_multiplied(
    x: torch.Tensor, multipliers: torch.Tensor, inner: int, zero: bool = True
) -> torch.Tensor:
    """``x`` with each element of channel ``c`` multiplied by ``multipliers[c]`` in ``x``'s
    dtype (the multipliers converted to it first), and with ``zero`` set to +0 where that
    multiplier is 0. Element ``i`` of ``x`` in row-major order lies in channel
    ``(i // inner) % len(multipliers)``: ``inner`` 1 for channels along the last dim, the
    product of the sizes after it otherwise."""
    channels = multipliers.numel()
    factor = multipliers.to(x.dtype).view(channels, 1)
    values = x.reshape(-1, channels, inner)
    product = values * factor
    if zero:
        product.masked_fill_(factor == 0, 0)  # (in place: no second tensor of x's size)
    return product.reshape(x.shape)


def _quantize_scaled_reference(
    x, multipliers, inner, bits, group_size, stochastic, seed, per_sample
):
    scaled = channel_multiplied(x, multipliers, inner)
    return quantize(scaled, bits, group_size, stochastic, seed, per_sample)


@torch.library.custom_op("actcore::quantize_scaled", mutates_args=())
def quantize_scaled(
    x: torch.Tensor,
    multipliers: torch.Tensor,
    inner: int,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int,
    per_sample: bool,
) -> _Tensors3:
    """``quantize(channel_multiplied(x, multipliers, inner), ...)`` in one pass over ``x``
    (no scaled copy of it): ``multipliers`` float32, one per channel."""
    args = (x, multipliers, inner, bits, group_size, stochastic, seed, per_sample)
    return _dispatch("quantize_scaled", x, _quantize_scaled_reference, *args)


@quantize_scaled.register_fake
def _quantize_scaled_fake(x, multipliers, inner, bits, group_size, stochastic, seed, per_sample):
    return quantize_fake(x, bits, group_size, stochastic, seed, per_sample)


def _dequantize_scaled_reference(
    payload, lo, step, multipliers, inner, bits, group_size, shape, dtype, per_sample
):
    out = dequantize(payload, lo, step, bits, group_size, shape, dtype, per_sample)
    if not out.is_contiguous():
        return channel_multiplied(out, multipliers, inner, zero=False)
    factor = multipliers.to(dtype).view(-1, 1)
    out.view(-1, multipliers.numel(), inner).mul_(factor)  # (fresh: in place, no second copy)
    return out


@torch.library.custom_op("actcore::dequantize_scaled", mutates_args=())
def dequantize_scaled(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    multipliers: torch.Tensor,
    inner: int,
    bits: int,
    group_size: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    per_sample: bool,
) -> torch.Tensor:
    """``channel_multiplied(dequantize(...), multipliers, inner, zero=False)`` in one pass
    (the inverse of :func:`quantize_scaled` with the reciprocal multipliers)."""
    args = (payload, lo, step, multipliers, inner, bits, group_size, shape, dtype, per_sample)
    return _dispatch("dequantize_scaled", payload, _dequantize_scaled_reference, *args)


@dequantize_scaled.register_fake
def _dequantize_scaled_fake(
    payload, lo, step, multipliers, inner, bits, group_size, shape, dtype, per_sample
):
    return payload.new_empty(tuple(shape), dtype=dtype)


@torch.library.custom_op("actcore::pack_bits", mutates_args=())
def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 values below 2**bits into ``ceil(n / 8) * bits`` bytes."""
    return _dispatch("pack_bits", values, pack_bits_reference, values, bits)


@pack_bits.register_fake
def _pack_bits_fake(values, bits):
    return values.new_empty((packed_nbytes(values.numel(), bits),), dtype=torch.uint8)


@torch.library.custom_op("actcore::unpack_bits", mutates_args=())
def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` values of a ``pack_bits`` payload, as a flat uint8 tensor."""
    return _dispatch("unpack_bits", packed, unpack_bits_reference, packed, bits, numel)


@unpack_bits.register_fake
def _unpack_bits_fake(packed, bits, numel):
    return packed.new_empty((numel,), dtype=torch.uint8)


@torch.library.custom_op("actcore::hash_uniform", mutates_args=())
def hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """The stochastic-rounding noise in [0, 1) of int64 element indices, as float32."""
    return _dispatch("hash_uniform", index, uniform_noise, index, seed)


@hash_uniform.register_fake
def _hash_uniform_fake(index, seed):
    return torch.empty_like(index, dtype=torch.float32)


@torch.library.custom_op("actcore::masked_quantize", mutates_args=())
def masked_quantize(
    x: torch.Tensor, mask: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> _Tensors3:
    """``quantize`` of the elements of ``x`` a packed 1-bit mask selects, as one row."""
    args = (x, mask, bits, group_size, stochastic, seed)
    return _dispatch("masked_quantize", x, masked_quantize_reference, *args)


@masked_quantize.register_fake
def _masked_quantize_fake(x, mask, bits, group_size, stochastic, seed) -> _Tensors3:
    # sizes from the mask's set bits (count): ceil(count / 8) * bits payload bytes and
    # ceil(count / group_size) groups, each its own data-dependent size
    ctx = torch.library.get_ctx()
    payload = x.new_empty((1, ctx.new_dynamic_size()), dtype=torch.uint8)
    lo = x.new_empty((1, ctx.new_dynamic_size()), dtype=META_DTYPE)
    return payload, lo, torch.empty_like(lo)


@torch.library.custom_op("actcore::masked_quantize_padded", mutates_args=())
def masked_quantize_padded(
    x: torch.Tensor, mask: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``masked_quantize`` in buffers sized for all of ``x``, plus the count (0-d int64)."""
    args = (x, mask, bits, group_size, stochastic, seed)
    return _dispatch("masked_quantize_padded", x, masked_quantize_padded_reference, *args)


@masked_quantize_padded.register_fake
def _masked_quantize_padded_fake(x, mask, bits, group_size, stochastic, seed):
    payload, lo, step = quantize_fake(x, bits, group_size, stochastic, seed, False)
    return payload, lo, step, x.new_empty((), dtype=torch.int64)


@torch.library.custom_op("actcore::masked_dequantize", mutates_args=())
def masked_dequantize(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    group_size: int,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of ``masked_quantize``: zeros of ``shape`` with the values at the mask's bits."""
    args = (payload, lo, step, mask, bits, group_size, shape, dtype)
    return _dispatch("masked_dequantize", payload, masked_dequantize_reference, *args)


@masked_dequantize.register_fake
def _masked_dequantize_fake(payload, lo, step, mask, bits, group_size, shape, dtype):
    return payload.new_empty(tuple(shape), dtype=dtype)


@torch.library.custom_op("actcore::apply_mask", mutates_args=())
def apply_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where a packed 1-bit mask is set, +0 elsewhere (contiguous)."""
    return _dispatch("apply_mask", x, apply_mask_reference, x, mask)


@apply_mask.register_fake
def _apply_mask_fake(x, mask):
    return x.new_empty(x.shape)


def _relu_mask_reference(x: torch.Tensor) -> torch.Tensor:
    return pack_bits(x.le(0).bitwise_not_().reshape(-1).view(torch.uint8), 1)


@torch.library.custom_op("actcore::relu_mask", mutates_args=())
def relu_mask(x: torch.Tensor) -> torch.Tensor:
    """The packed 1-bit mask (row-major) of the elements of ``x`` that are not ``<= 0``
    (positive or NaN: where ReLU's backward passes the gradient)."""
    return _dispatch("relu_mask", x, _relu_mask_reference, x)


@relu_mask.register_fake
def _relu_mask_fake(x):
    return x.new_empty((packed_nbytes(x.numel(), 1),), dtype=torch.uint8)
