"""Quantization at the ends of every dtype's range: finite in, finite out; NaN/inf kept.

A property test (hypothesis) over fp32/fp16/bf16 tensors that mix ordinary values with the
largest finite values, bfloat16's limit, subnormals, infinities and NaN, for the front end
(native CPU kernels when built) and the pure-PyTorch reference alike.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actcore import ops
from actcore.ops import quantization
from actcore.ops.quantization import BF16_MAX

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _special(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    top = info.max
    values = [top, -top, top * 0.75, -top * 0.5, info.tiny, -info.tiny, info.tiny / 4, 0.0]
    values += [min(top, BF16_MAX), -min(top, BF16_MAX), 1.0, -3.5]
    return values


@st.composite
def tensors(draw: st.DrawFn) -> tuple[str, torch.Tensor]:
    name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[name]
    rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 40))
    plain = st.floats(-1e4, 1e4, allow_nan=False, width=32)
    special = st.sampled_from(_special(dtype))
    nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
    value = st.one_of(plain, special, special, nonfinite if draw(st.booleans()) else special)
    flat = draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    top = torch.finfo(dtype).max
    x = torch.tensor(flat, dtype=torch.float64).view(rows, cols)
    x = torch.where(x.isfinite(), x.clamp(-top, top), x)  # finite stays finite in dtype
    return name, x.to(dtype)


def _check(x: torch.Tensor, bits: int, group_size: int, per_sample: bool, packed, y) -> None:
    """Each group: all finite -> finite and within the documented bound; else NaN."""
    rows, cols = quantization.rows_and_cols(x.shape, per_sample)
    xs = x.double().reshape(rows, cols)
    ys = y.double().reshape(rows, cols)
    lo_all, step_all = packed.lo.double(), packed.step.double()
    levels = 2**bits - 1
    ulp = torch.finfo(x.dtype).eps
    for r in range(rows):
        for g, c0 in enumerate(range(0, cols, group_size)):
            xg, yg = xs[r, c0 : c0 + group_size], ys[r, c0 : c0 + group_size]
            if not bool(xg.isfinite().all()):
                assert bool(yg.isnan().all()), f"a non-finite group decoded to {yg}"
                continue
            assert bool(yg.isfinite().all()), f"finite {xg} decoded to {yg}"
            lo, step = float(lo_all[r, g]), float(step_all[r, g])
            assert math.isfinite(lo) and math.isfinite(step) and step >= 0
            hi = lo + levels * step
            outside = (lo - xg).clamp_min(0) + (xg - hi).clamp_min(0)
            span = float(xg.max() - xg.min())
            if float(xg.abs().max()) <= BF16_MAX and not (bits == 1 and span >= BF16_MAX):
                # up to the float32 rounding of max - lo
                slack = 2.0**-23 * span
                assert float(outside.max()) <= slack, "the documented interval must hold the group"
            # one step, plus the distance outside [lo, hi], plus the output dtype's rounding
            bound = step + outside + ulp * torch.maximum(xg.abs(), yg.abs())
            err = (yg - xg).abs()
            assert bool((err <= bound).all()), f"error {err} above {bound} for {xg}"


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    case=tensors(),
    bits=st.integers(1, 8),
    group_size=st.sampled_from([8, 16, 32]),
    per_sample=st.booleans(),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_dequantize_is_finite_bounded_and_keeps_nan(
    case, bits, group_size, per_sample, stochastic, seed
):
    _, x = case
    packed = ops.quantize(
        x, bits, group_size=group_size, stochastic=stochastic, seed=seed, per_sample=per_sample
    )
    y = ops.dequantize(packed)
    assert y.dtype == x.dtype and y.shape == x.shape
    _check(x, bits, group_size, per_sample, packed, y)
    # the reference follows the same rules, bit for bit
    s = seed if stochastic else 0
    payload, lo, step = quantization.quantize_reference(
        x, bits, group_size, stochastic, s, per_sample
    )
    for ref, got in ((lo, packed.lo), (step, packed.step)):
        _assert_same(ref, got)
    yr = quantization.dequantize_reference(
        payload, lo, step, bits, group_size, x.shape, x.dtype, per_sample
    )
    _assert_same(yr, y)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN equals any NaN (NaN bits are not the contract)."""
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a[~a.isnan()], b[~b.isnan()]
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_range_ends_stay_finite(name, bits):
    """Each issue's case: fp16 near +-65504 gave inf, fp32 near +-3e38 gave NaN."""
    dtype = DTYPES[name]
    top = torch.finfo(dtype).max
    x = torch.tensor([[-top, top, 0.0, 1.0] * 8, [-top] * 32, [top * 0.99] * 32], dtype=dtype)
    for seed in range(3):
        y = ops.dequantize(ops.quantize(x, bits, group_size=32, seed=seed))
        assert bool(y.isfinite().all()), y
        # a constant group decodes to its value up to the output dtype's rounding (and, for
        # fp32 past bfloat16's range, saturation at BF16_MAX: below 2**-8 relative)
        rel = 2.0**-8 if dtype == torch.float32 else torch.finfo(dtype).eps
        assert float((y[1].double() + top).abs().max()) <= rel * top
