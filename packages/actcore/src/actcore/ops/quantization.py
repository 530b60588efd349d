"""Reference per-group k-bit quantization (the pure-PyTorch path of the ops).

A tensor is viewed as ``N`` rows of ``M`` elements (``N`` = the sample dimension when
``per_sample``, else one row). Each row is cut into groups of ``group_size`` elements (the
last one may be partial). Per group we store, in bfloat16:

* ``lo``: the group minimum rounded *down* to bfloat16, and
* ``step``: ``(max - lo) / (2**bits - 1)`` rounded *up* to bfloat16,

so every element lies in ``[lo, lo + step * (2**bits - 1)]`` whatever the rounding, and
``q = floor((x - lo) / step + u)`` with ``u ~ U[0, 1)`` is unbiased: ``E[lo + q * step] = x``.
Codes past the end of a row (up to the next multiple of 8) are 0.

Extreme finite values. bfloat16 holds magnitudes up to ``BF16_MAX`` (about 3.3895e38), fp32
up to 3.4028e38. Metadata that would round past bfloat16's finite range is rounded inward
instead: ``lo`` below ``-BF16_MAX`` becomes ``-BF16_MAX`` and a step above it becomes
``BF16_MAX``. A group whose span ``max - lo`` overflows the compute dtype (fp32 values of
both signs near 1.7e38 and beyond) computes its step and codes on values scaled by 1/4, which
is exact for every value that matters there. Dequantization computes
``(q * (step / 4) + lo / 4) * 4``, which equals ``q * step + lo`` bit for bit whenever that does
not overflow (``q * step`` is exact: 8 by 8 significant bits), and clamps the result to the
output dtype's finite range (an fp16 group minimum -65504 has ``lo = -65536``). So a finite
input always dequantizes to finite values, and the error of every element is below one step
of its group plus its distance outside ``[lo, lo + step * (2**bits - 1)]``, an interval that
holds the whole group (up to the float32 rounding of ``max - lo``) unless the group holds
fp32/fp64 values beyond ``BF16_MAX`` (they saturate there: relative error below 2**-8 for
fp32) or a 1-bit group spans ``BF16_MAX`` or more. Near the output range's ends, clamping makes the rounding slightly biased.

A group that holds a NaN or an infinity has a non-finite ``lo`` or ``step``, and all of its
elements dequantize to NaN: a non-finite input is never hidden as a finite number.

Arithmetic is fp32 (fp64 for fp64 input) and follows a fixed order (no fused multiply-add),
so a native kernel can match it bit for bit. Work is done in blocks of about
``BLOCK_ELEMENTS`` elements to bound temporary memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from .bitpack import pack_bits_reference, packed_nbytes, unpack_bits_reference
from .noise import hash_index, uniform_from_hash

__all__ = [
    "BF16_MAX",
    "BLOCK_ELEMENTS",
    "META_DTYPE",
    "compute_dtype",
    "dequantize_reference",
    "quantize_reference",
    "round_to_bf16",
    "rows_and_cols",
]

META_DTYPE = torch.bfloat16
BF16_MAX = torch.finfo(torch.bfloat16).max  # 0x7F7F: the largest finite bfloat16
BLOCK_ELEMENTS = 1 << 16  # small enough for temporaries to stay in cache


def rows_and_cols(shape: Sequence[int], per_sample: bool) -> tuple[int, int]:
    """The (rows, elements per row) view that grouping uses for a tensor of ``shape``."""
    if len(shape) == 0:
        return 1, 1
    if per_sample:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_float32_directed(t: torch.Tensor, up: bool) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t
    f = t.float()
    if up:
        return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)
    return torch.where(f.double() > t, torch.nextafter(f, torch.full_like(f, -math.inf)), f)


def round_to_bf16(t: torch.Tensor, up: bool) -> torch.Tensor:
    """Round fp32/fp64 values to bfloat16 toward +inf (``up``) or -inf, NaN kept."""
    if up:
        return round_to_bf16(-t, up=False).neg()
    t32 = _to_float32_directed(t, up=False)
    bits = t32.view(torch.int32)
    top = torch.bitwise_right_shift(bits, 16)  # arithmetic: the upper half, sign included
    inexact = torch.bitwise_and(bits, 0xFFFF) != 0
    top = top + (inexact & (bits < 0)).to(torch.int32)  # negative: one more ulp of magnitude
    out = top.to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(t32), t32.to(torch.bfloat16), out)


def _blocks(rows: int, cols: int, group_size: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield (row0, row1, col0, col1) tiles; col0 is always a multiple of group_size."""
    if cols > BLOCK_ELEMENTS:
        col_step, row_step = max(group_size, BLOCK_ELEMENTS // group_size * group_size), 1
    else:
        col_step, row_step = cols, max(1, BLOCK_ELEMENTS // cols)
    for r0 in range(0, rows, row_step):
        for c0 in range(0, cols, col_step):
            yield r0, min(rows, r0 + row_step), c0, min(cols, c0 + col_step)


def _metadata(
    mn: torch.Tensor, mx: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: ``lo`` and ``step`` (bfloat16) and the scale its codes are computed at.

    ``lo`` rounds down and ``step`` up, except where that would leave bfloat16's finite
    range for a finite group (rounded inward to ``+-BF16_MAX``). Where ``max - lo``
    overflows, the step is computed from the values times 1/4 and the scale is 1/4, else 1.
    """
    cdt = mn.dtype
    finite_min = torch.isfinite(mn)
    lo_b = round_to_bf16(mn, up=False)
    lo_b = torch.where(torch.isneginf(lo_b) & finite_min, -BF16_MAX, lo_b)
    lo = lo_b.to(cdt)
    finite = torch.isfinite(mx) & torch.isfinite(lo)
    span = mx - lo
    huge = torch.isinf(span) & finite
    # divide by a tensor, not a Python number: CUDA turns division by a scalar into a
    # multiplication by its reciprocal, which would make the step device-dependent
    div = span.new_full((), levels)
    raw = torch.where(huge, (mx * 0.25 - lo * 0.25) / div * 4.0, span / div)
    raw = torch.where(raw < 0, 0.0, raw)  # all values below -BF16_MAX: lo is above max
    step_b = round_to_bf16(raw, up=True)
    step_b = torch.where(torch.isposinf(step_b) & finite, BF16_MAX, step_b)
    scale = torch.where(huge, 0.25, 1.0).to(cdt)
    return lo_b, step_b, scale


def quantize_reference(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, per_sample: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = rows_and_cols(x.shape, per_sample)
    groups = -(-cols // group_size)
    payload = torch.empty((rows, packed_nbytes(cols, bits)), dtype=torch.uint8, device=x.device)
    lo = torch.empty((rows, groups), dtype=META_DTYPE, device=x.device)
    step = torch.empty_like(lo)
    if rows * cols == 0:
        return payload, lo, step
    x2d = x.reshape(rows, cols)
    cdt = compute_dtype(x.dtype)
    levels = (1 << bits) - 1
    for r0, r1, c0, c1 in _blocks(rows, cols, group_size):
        r, c = r1 - r0, c1 - c0
        gb = -(-c // group_size)
        cp = gb * group_size
        xb = x2d[r0:r1, c0:c1].to(cdt)
        if cp != c:  # repeat the last element: the group's min and max stay the same
            xb = torch.cat([xb, xb[:, -1:].expand(r, cp - c)], dim=1)
        g = xb.view(r, gb, group_size)
        lo_b, step_b, scale = _metadata(g.amin(-1), g.amax(-1), levels)
        lo_c = lo_b.to(cdt).unsqueeze(-1)
        step_c = step_b.to(cdt).unsqueeze(-1)
        scale = scale.unsqueeze(-1)
        # scale is 1 (exact: the plain formula) except in groups whose span overflows
        v = (g * scale - lo_c * scale).div_(step_c * scale)
        v.masked_fill_(step_c == 0, 0.0)  # a constant group: every code is 0
        if stochastic:
            first, last = r0 * cols + c0, (r1 - 1) * cols + c0 + cp - 1
            index = torch.arange(r0, r1, dtype=torch.int64, device=x.device).mul_(cols).unsqueeze(
                1
            ) + torch.arange(c0, c0 + cp, dtype=torch.int64, device=x.device)
            v.add_(uniform_from_hash(hash_index(index, seed, (first, last)), cdt).view_as(v))
        else:
            v.add_(0.5)
        v = v.floor_().clamp_(0, levels).nan_to_num_(nan=0.0)
        q = v.to(torch.uint8).view(r, cp)
        c8 = -(-c // 8) * 8
        q = q[:, :c8].contiguous()
        q[:, c:] = 0
        b0 = c0 // 8 * bits
        payload[r0:r1, b0 : b0 + c8 // 8 * bits] = pack_bits_reference(q, bits).view(r, -1)
        g0 = c0 // group_size
        lo[r0:r1, g0 : g0 + gb] = lo_b
        step[r0:r1, g0 : g0 + gb] = step_b
    return payload, lo, step


def dequantize_reference(
    payload: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group_size: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    per_sample: bool,
) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=dtype, device=payload.device)
    rows, cols = rows_and_cols(out.shape, per_sample)
    if rows * cols == 0:
        return out
    out2d = out.view(rows, cols)
    cdt = compute_dtype(dtype)
    top = torch.finfo(dtype).max
    for r0, r1, c0, c1 in _blocks(rows, cols, group_size):
        r, c = r1 - r0, c1 - c0
        gb = -(-c // group_size)
        cp = gb * group_size
        c8 = -(-c // 8) * 8
        b0 = c0 // 8 * bits
        q = unpack_bits_reference(payload[r0:r1, b0 : b0 + c8 // 8 * bits], bits, r * c8)
        qf = q.view(r, c8).to(cdt)
        if cp != c8:
            qf = torch.cat([qf, qf.new_zeros(r, cp - c8)], dim=1)
        g0 = c0 // group_size
        lo_c = lo[r0:r1, g0 : g0 + gb].to(cdt).unsqueeze(-1)
        step_c = step[r0:r1, g0 : g0 + gb].to(cdt).unsqueeze(-1)
        finite = torch.isfinite(lo_c) & torch.isfinite(step_c)
        lo_q = torch.where(finite, lo_c * 0.25, math.nan)  # non-finite metadata: NaN
        # (q * step/4 + lo/4) * 4: q * step/4 is exact, so this is q * step + lo without
        # its overflow; then clamped into the output dtype's finite range (NaN stays)
        values = qf.view(r, gb, group_size).mul_(step_c * 0.25).add_(lo_q).mul_(4.0)
        values.clamp_(-top, top)
        out2d[r0:r1, c0:c1] = values.view(r, cp)[:, :c]
    return out
