"""Checked front end of the ``actcore::*`` ops: validation, defaults and ``Packed``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import library
from .noise import SEED_LIMIT
from .packed import Packed
from .seeds import new_seed, reset_seed_stream

# the ops' checked API, re-exported by actcore.ops; the check_* validators serve the compressors and policies
__all__ = [
    "FLOAT_DTYPES",
    "apply_mask",
    "dequantize",
    "dequantize_scaled",
    "hash_uniform",
    "masked_dequantize",
    "masked_quantize",
    "masked_quantize_padded",
    "new_seed",
    "pack_bits",
    "pack_mask",
    "quantize",
    "quantize_scaled",
    "relu_mask",
    "reset_seed_stream",
    "unpack_bits",
    "unpack_mask",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FLOAT_NAMES = ", ".join(str(d) for d in FLOAT_DTYPES)


def check_bits(bits: object, name: str = "bits", high: int = 8) -> int:
    """``bits`` as an int in ``1..high`` (8: quantization; FewBit's derivative codes: 4),
    else TypeError/ValueError naming the value: actcore's one bits check."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in 1..{high}, got {bits!r} ({type(bits).__name__})")
    if not 1 <= bits <= high:
        raise ValueError(f"{name} must be in 1..{high}, got {bits}")
    return bits


def check_group_size(group_size: object) -> int:
    """``group_size`` as a positive multiple of 8, else TypeError/ValueError."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
    return group_size


def check_float_dtype(dtype: torch.dtype, what: str = "quantize") -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} takes floating tensors ({_FLOAT_NAMES}), got {dtype}")


def check_seed(seed: int | None) -> int:
    if seed is None:
        return new_seed()
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def _check_input(x: object, what: str) -> None:
    """TypeError unless ``x`` is a floating tensor (``what``: the op's name, for the message)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    check_float_dtype(x.dtype, what)


def _unlinked(t: torch.Tensor) -> torch.Tensor:
    """``t`` off the autograd graph (the ops have no derivative); as it is when it is off
    already, as inside an autograd function's forward, without a call."""
    return t.detach() if t.requires_grad else t


def _check_options(
    bits: object, group_size: object, stochastic: bool, seed: int | None
) -> tuple[int, int, int]:
    """The quantizing ops' checked ``bits``, ``group_size`` and seed (a new one for
    ``seed=None``, 0 without ``stochastic``)."""
    bits = check_bits(bits)
    group_size = check_group_size(group_size)
    return bits, group_size, check_seed(seed) if stochastic else 0


def quantize(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    seed: int | None = None,
    per_sample: bool = True,
) -> Packed:
    """Quantize ``x`` per group of ``group_size`` elements to ``bits`` bits.

    Groups lie within each sample (dim 0) when ``per_sample``, else run over the flattened
    tensor. Each group keeps its minimum and step in bfloat16. With ``stochastic`` the
    rounding is unbiased (``E[dequantize(quantize(x))] == x``), its noise a hash of
    ``(seed, element index)``: the same seed gives the same result on every backend, and
    ``seed=None`` draws one from torch's default generator. Every element's error is below
    one step of its group. A group containing NaN or +-inf dequantizes to NaN.
    """
    _check_input(x, "quantize")
    bits, group_size, seed = _check_options(bits, group_size, stochastic, seed)
    payload, lo, step = library.quantize(
        _unlinked(x), bits, group_size, bool(stochastic), seed, bool(per_sample)
    )
    return Packed(payload, lo, step, x.shape, x.dtype, bits, group_size, bool(per_sample))


def _check_multipliers(
    shape: Sequence[int], device: torch.device, multipliers: object, inner: object, what: str
) -> None:
    """TypeError / ValueError unless ``multipliers`` (float32, 1-D, on ``device``) and
    ``inner`` tile a tensor of ``shape`` into channels."""
    if not isinstance(multipliers, torch.Tensor) or multipliers.dtype != torch.float32:
        got = multipliers.dtype if isinstance(multipliers, torch.Tensor) else type(multipliers)
        raise TypeError(f"{what}: multipliers must be a float32 tensor, got {got}")
    if multipliers.dim() != 1 or multipliers.device != device:
        raise ValueError(
            f"{what}: multipliers must be 1-D on {device}, got shape "
            f"{tuple(multipliers.shape)} on {multipliers.device}"
        )
    if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1:
        raise ValueError(f"{what}: inner must be an int >= 1, got {inner!r}")
    channels = multipliers.numel()
    if channels == 0 or math.prod(shape) % (channels * inner):
        raise ValueError(
            f"{what}: {channels} channels of {inner} elements do not tile a tensor of "
            f"shape {tuple(shape)}"
        )


def quantize_scaled(
    x: torch.Tensor,
    multipliers: torch.Tensor,
    inner: int,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    seed: int | None = None,
    per_sample: bool = True,
) -> Packed:
    """:func:`quantize` of ``x`` with each channel multiplied by its multiplier (in ``x``'s
    dtype; set to 0 where that is 0), without a scaled copy of ``x``: element ``i`` in
    row-major order lies in channel ``(i // inner) % len(multipliers)``. With powers of two
    this is exactly ``quantize(x / 2**e)`` (:class:`actcore.compressors.ChannelScaled`)."""
    _check_input(x, "quantize_scaled")
    _check_multipliers(x.shape, x.device, multipliers, inner, "quantize_scaled")
    bits, group_size, seed = _check_options(bits, group_size, stochastic, seed)
    payload, lo, step = library.quantize_scaled(
        _unlinked(x), multipliers, inner, bits, group_size, bool(stochastic), seed, bool(per_sample)
    )
    return Packed(payload, lo, step, x.shape, x.dtype, bits, group_size, bool(per_sample))


def dequantize_scaled(packed: Packed, multipliers: torch.Tensor, inner: int) -> torch.Tensor:
    """:func:`dequantize` with each channel then multiplied by its multiplier (see
    :func:`quantize_scaled`; the reciprocals undo it), in one pass."""
    if not isinstance(packed, Packed):
        raise TypeError(f"dequantize_scaled expects a Packed, got {type(packed).__name__}")
    _check_multipliers(packed.shape, packed.payload.device, multipliers, inner, "dequantize_scaled")
    return library.dequantize_scaled(
        packed.payload,
        packed.lo,
        packed.step,
        multipliers,
        inner,
        packed.bits,
        packed.group_size,
        list(packed.shape),
        packed.dtype,
        packed.per_sample,
    )


def dequantize(packed: Packed) -> torch.Tensor:
    """The tensor a :class:`Packed` stands for: same shape, dtype and device as the input."""
    if not isinstance(packed, Packed):
        raise TypeError(f"dequantize expects a Packed, got {type(packed).__name__}")
    return library.dequantize(
        packed.payload,
        packed.lo,
        packed.step,
        packed.bits,
        packed.group_size,
        list(packed.shape),
        packed.dtype,
        packed.per_sample,
    )


def _check_mask(mask: object, numel: int, what: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.uint8:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{what} takes a packed 1-bit mask (uint8, from pack_mask), got {got}")
    if mask.numel() < -(-numel // 8):
        raise ValueError(
            f"{what}: a mask over {numel} elements takes {-(-numel // 8)} bytes, got {mask.numel()}"
        )
    return mask


def _masked_args(
    x: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int | None,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool, int]:
    """The masked quantize ops' arguments, checked, in the op schema's order."""
    _check_input(x, what)
    _check_mask(mask, x.numel(), what)
    bits, group_size, seed = _check_options(bits, group_size, stochastic, seed)
    return _unlinked(x), _unlinked(mask), bits, group_size, bool(stochastic), seed


def masked_quantize(
    x: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize only the elements of ``x`` that ``mask`` (``pack_mask`` of a bool tensor of
    ``x``'s shape) selects: ``(payload, lo, step)``, exactly what
    ``quantize(x.reshape(-1)[m], bits, per_sample=False, ...)`` holds for the unpacked ``m``,
    without searching ``x`` (the mask's bits say where the values are).
    """
    return library.masked_quantize(
        *_masked_args(x, mask, bits, group_size, stochastic, seed, "masked_quantize")
    )


def masked_quantize_padded(
    x: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    stochastic: bool = True,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_quantize` without waiting for the count of selected elements:
    ``(payload, lo, step, count)``, the buffers sized for every element of ``x`` (the first
    ``count`` values' part is :func:`masked_quantize`'s; the rest is never read), ``count``
    a 0-d int64 tensor on ``x``'s device. On CUDA nothing synchronizes with the host; cut
    the buffers to the count once it is there (``actcore.compressors.zero_value`` does).
    :func:`masked_dequantize` takes either op's buffers.
    """
    return library.masked_quantize_padded(
        *_masked_args(x, mask, bits, group_size, stochastic, seed, "masked_quantize_padded")
    )


def masked_dequantize(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    mask: torch.Tensor,
    bits: int,
    group_size: int,
    shape: Sequence[int] | torch.Size,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The tensor :func:`masked_quantize` stood for: +0 where ``mask`` is clear, the restored
    values in order where it is set."""
    check_float_dtype(dtype, "masked_dequantize")
    _check_mask(mask, torch.Size(shape).numel(), "masked_dequantize")
    return library.masked_dequantize(
        payload, lo, step, mask, check_bits(bits), check_group_size(group_size), list(shape), dtype
    )


def apply_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where the packed 1-bit ``mask`` is set and +0 elsewhere: ``torch.where(m, x, 0)``
    for the unpacked ``m``, read straight from the bits (contiguous result)."""
    check_float_dtype(x.dtype, "apply_mask")
    _check_mask(mask, x.numel(), "apply_mask")
    return library.apply_mask(x, mask)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 values below ``2**bits`` into ``ceil(n / 8) * bits`` bytes (row-major)."""
    bits = check_bits(bits)
    if values.dtype != torch.uint8:
        raise TypeError(f"pack_bits takes uint8 values, got {values.dtype}")
    return library.pack_bits(values, bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` values of a :func:`pack_bits` result, as flat uint8."""
    bits = check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits takes a uint8 payload, got {packed.dtype}")
    if numel < 0 or -(-numel // 8) * bits > packed.numel():
        raise ValueError(
            f"a payload of {packed.numel()} bytes holds at most "
            f"{packed.numel() // bits * 8} values of {bits} bits, asked for {numel}"
        )
    return library.unpack_bits(packed, bits, numel)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor at 1 bit per element (``ceil(n / 8)`` bytes)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_mask takes a bool tensor, got {mask.dtype}")
    return library.pack_bits(mask.reshape(-1).view(torch.uint8), 1)


def relu_mask(x: torch.Tensor) -> torch.Tensor:
    """``pack_mask(~(x <= 0))`` in one pass: where ReLU's backward passes the gradient
    (positive or NaN elements of ``x``), 1 bit per element, row-major."""
    _check_input(x, "relu_mask")
    return library.relu_mask(_unlinked(x))


def unpack_mask(packed: torch.Tensor, shape: Sequence[int] | torch.Size) -> torch.Tensor:
    """The bool tensor of ``shape`` that :func:`pack_mask` packed."""
    numel = torch.Size(shape).numel()
    return unpack_bits(packed, 1, numel).view(torch.bool).view(tuple(shape))


def hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """The stochastic-rounding noise (float32 in [0, 1)) for int64 element ``index``."""
    if index.dtype != torch.int64:
        raise TypeError(f"hash_uniform takes int64 indices, got {index.dtype}")
    return library.hash_uniform(index, check_seed(seed))
