"""Cases and checks shared by the native-kernel tests of every device (test_native*.py)."""

from __future__ import annotations

import pytest
import torch

OPCHECK_CASES = 20


def assert_same(native: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Equal with atol=0 (NaN equals NaN: NaN bit patterns are not part of the contract)."""
    assert native.dtype == reference.dtype, what
    assert native.shape == reference.shape, what
    a, b = native.cpu(), reference.cpu()
    if a.is_floating_point():
        nan_a, nan_b = a.isnan(), b.isnan()
        assert torch.equal(nan_a, nan_b), f"{what}: NaN positions differ"
        a, b = a[~nan_a], b[~nan_b]
    if not torch.equal(a, b):
        bad = (a != b).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: differs at {bad}: {a.flatten()[bad]} vs {b.flatten()[bad]}")


def bit_exact_inputs(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) cases: shapes, layouts, value ranges, special values."""
    g = torch.Generator().manual_seed(1234)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)

    info = torch.finfo(dtype)
    special = randn(4, 128)
    values = [0.0, -0.0, 1.0, -1.0, info.tiny, -info.tiny, info.max, -info.max, info.eps]
    values += [info.tiny / 4, -info.tiny / 4]  # subnormals
    special[0, : len(values)] = torch.tensor(values, dtype=torch.float64).to(dtype)
    special[1, 5] = float("nan")
    special[2, 7] = float("inf")
    special[3, 9] = float("-inf")
    cases = [
        ("empty", randn(0, 5)),
        ("empty-cols", randn(4, 0)),
        ("scalar", randn(())),
        ("1d-odd", randn(37)),
        ("2d", randn(3, 70)),
        ("3d-odd", randn(3, 5, 37)),
        ("wide", randn(2, 3000, scale=10, shift=3)),
        ("tall", randn(257, 9)),
        ("row-of-8", randn(5, 64)),
        ("tiny-values", randn(4, 100, scale=1e-30 if dtype == torch.float64 else 1e-3)),
        # float32 steps on both sides of the kernels' division-free range [2**-60, 2**60]
        ("steps-near-2**-60", randn(4, 300, scale=3e-17)),
        ("steps-below-2**-60", randn(4, 300, scale=1e-19)),
        ("steps-near-2**60", randn(4, 300, scale=4e19)),
        ("steps-above-2**60", randn(4, 300, scale=1e22)),
        ("constant", torch.full((3, 50), 0.1, dtype=dtype)),
        ("zeros", torch.zeros(2, 40, dtype=dtype)),
        ("negative-zeros", torch.full((2, 40), -0.0, dtype=dtype)),
        ("transposed", randn(40, 6).t()),
        ("sliced", randn(6, 90)[:, ::3]),
        ("offset", randn(7, 33)[1:]),
        ("channels-last", randn(2, 3, 5, 7).to(memory_format=torch.channels_last)),
        ("special", special),
        ("all-nan", torch.full((2, 24), float("nan"), dtype=dtype)),
    ]
    cases.append(("extremes", _extremes(dtype)))
    if dtype == torch.float64:
        cases.append(("beyond-fp32", randn(3, 64, scale=1e300)))
        cases.append(("below-fp32", randn(3, 64, scale=1e-300)))
    if dtype == torch.float32:
        cases.append(("overflowing-range", torch.tensor([[3e38, -3e38] * 8], dtype=dtype)))
    return cases


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 64 at the ends of ``dtype``'s range: both signs (a span that overflows
    fp32), one sign only, past bfloat16's largest value, mixed with small values."""
    top = torch.finfo(dtype).max
    bf16 = torch.finfo(torch.bfloat16).max
    rows = [
        [top, -top] * 32,
        [-top] * 64,
        [top] * 64,
        [top * 0.75, -top * 0.75, 1.0, -1e-3] * 16,
        [min(top, bf16), -min(top, bf16), 0.0, 5.0] * 16,
        [-top, -top * 0.999, 0.0, top * 0.5] * 16,
        [top * 0.5, top * 0.25, -top * 0.5, torch.finfo(dtype).tiny] * 16,
    ]
    return torch.tensor(rows, dtype=torch.float64).clamp(-top, top).to(dtype)


def opcheck_cases(device: str) -> list[tuple[object, tuple]]:
    """(op, args) pairs covering every op, dtypes, layouts and group sizes on ``device``."""
    x = torch.randn(3, 70, device=device)
    payload, lo, step = torch.ops.actcore.quantize(x, 3, 32, True, 5, True)
    values = torch.randint(0, 8, (37,), dtype=torch.uint8, device=device)
    nchw = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    arange = torch.arange(100, device=device)
    relu = torch.relu(torch.randn(3, 70, device=device))
    mask = torch.ops.actcore.pack_bits(relu.ne(0).reshape(-1).view(torch.uint8), 1)
    m_payload, m_lo, m_step = torch.ops.actcore.masked_quantize(relu, mask, 2, 16, True, 4)
    scales = torch.exp2(-torch.arange(70, device=device) % 5.0)
    return [
        (torch.ops.actcore.quantize.default, (x, 3, 32, True, 5, True)),
        (torch.ops.actcore.quantize.default, (x.half().t(), 2, 8, False, 0, False)),
        (torch.ops.actcore.quantize.default, (x.double()[:, ::2], 8, 512, True, 9, True)),
        (torch.ops.actcore.quantize.default, (nchw.bfloat16(), 1, 24, True, 2, True)),
        (torch.ops.actcore.dequantize.default, (payload, lo, step, 3, 32, [3, 70], x.dtype, True)),
        (torch.ops.actcore.pack_bits.default, (values, 3)),
        (torch.ops.actcore.unpack_bits.default, (torch.ops.actcore.pack_bits(values, 3), 3, 37)),
        (torch.ops.actcore.hash_uniform.default, (arange, 17)),
        (torch.ops.actcore.hash_uniform.default, (arange.view(10, 10).t(), 3)),
        (torch.ops.actcore.masked_quantize.default, (relu, mask, 2, 16, True, 4)),
        (torch.ops.actcore.masked_quantize.default, (relu.t().bfloat16(), mask, 3, 8, False, 0)),
        (
            torch.ops.actcore.masked_dequantize.default,
            (m_payload, m_lo, m_step, mask, 2, 16, [3, 70], torch.float32),
        ),
        (torch.ops.actcore.apply_mask.default, (x, mask)),
        (torch.ops.actcore.apply_mask.default, (x.t().double(), mask)),
        (torch.ops.actcore.masked_quantize_padded.default, (relu.half(), mask, 3, 24, True, 7)),
        (torch.ops.actcore.relu_mask.default, (x,)),
        (torch.ops.actcore.relu_mask.default, (nchw.half(),)),
        (torch.ops.actcore.quantize_scaled.default, (x, scales, 1, 3, 32, True, 5, True)),
        (torch.ops.actcore.quantize_scaled.default, (nchw, scales[:3], 20, 2, 8, False, 0, False)),
        (
            torch.ops.actcore.dequantize_scaled.default,
            (payload, lo, step, scales, 1, 3, 32, [3, 70], x.dtype, True),
        ),
    ]


def check_errors_are_clear(device: str) -> None:
    """The kernels' argument checks name the bad value and what is allowed."""
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"bits must be in 1\.\.8, got 9"):
        torch.ops.actcore.quantize.default(x, 9, 8, False, 0, True)
    with pytest.raises(RuntimeError, match="multiple of 8, got 12"):
        torch.ops.actcore.quantize.default(x, 2, 12, False, 0, True)
    with pytest.raises(RuntimeError, match="takes float32, float16, bfloat16 or float64"):
        torch.ops.actcore.quantize.default(x.int(), 2, 8, False, 0, True)
    payload, lo, step = torch.ops.actcore.quantize.default(x, 2, 8, False, 0, True)
    with pytest.raises(RuntimeError, match="payload has shape"):
        torch.ops.actcore.dequantize.default(
            payload[:, :1], lo, step, 2, 8, [4, 8], torch.float32, True
        )
    with pytest.raises(RuntimeError, match="holds at most"):
        torch.ops.actcore.unpack_bits.default(
            torch.zeros(2, dtype=torch.uint8, device=device), 2, 9
        )
    short = torch.zeros(3, dtype=torch.uint8, device=device)  # 24 bits for 32 elements
    with pytest.raises(RuntimeError, match="over 32 elements takes 4 bytes, got 3"):
        torch.ops.actcore.masked_quantize.default(x, short, 2, 8, False, 0)
    with pytest.raises(RuntimeError, match="packed 1-bit mask"):
        torch.ops.actcore.apply_mask.default(x, short.bool())
    with pytest.raises(RuntimeError, match="over 32 elements takes 4 bytes"):
        torch.ops.actcore.masked_dequantize.default(
            payload, lo, step, short, 2, 8, [4, 8], torch.float32
        )


def check_masked_ops(device: str, dtype: torch.dtype) -> None:
    """masked_quantize, masked_quantize_padded and masked_dequantize on ``device`` against
    their references on CPU, bit for bit, over :func:`masked_cases`."""
    from actcore.ops import masked

    for name, x, keep in masked_cases(dtype):
        mask = torch.ops.actcore.pack_bits(keep.reshape(-1).view(torch.uint8), 1)
        xd, md = x.to(device), mask.to(device)
        for bits in (1, 2, 3, 8):
            for group_size in (8, 24, 256):
                for stochastic in (True, False):
                    args = (bits, group_size, stochastic, 11 if stochastic else 0)
                    what = f"{name} {dtype} bits={bits} G={group_size} stochastic={stochastic}"
                    ref = masked.masked_quantize_reference(x, mask, *args)
                    got = torch.ops.actcore.masked_quantize.default(xd, md, *args)
                    *padded, count = torch.ops.actcore.masked_quantize_padded.default(xd, md, *args)
                    assert int(count) == int(keep.sum()), what
                    for a, p, b, part in zip(
                        got, padded, ref, ("payload", "lo", "step"), strict=True
                    ):
                        assert_same(a, b, f"{part} of {what}")
                        if part == "payload":  # the last byte's bits past the count are free
                            full = int(count) // 8 * bits
                            p, b = p[:, :full], b[:, :full]
                        assert_same(p[:, : b.shape[1]], b, f"padded {part} of {what}")
                    shape = list(x.shape)
                    ry = masked.masked_dequantize_reference(
                        *ref, mask, bits, group_size, shape, dtype
                    )
                    for source, kind in ((got, "exact"), (padded, "padded")):
                        y = torch.ops.actcore.masked_dequantize.default(
                            *source, md, bits, group_size, shape, dtype
                        )
                        assert_same(y, ry, f"masked_dequantize of {what} ({kind})")


def masked_cases(dtype: torch.dtype) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, CPU tensor, bool mask of its nonzeros) cases for the masked ops: densities,
    shapes around the 64-element mask words, layouts and special values."""
    g = torch.Generator().manual_seed(99)
    cases = []
    shapes = [(1,), (37,), (64,), (65,), (3, 70), (2, 3, 129), (4, 16, 9, 11), (2, 3000)]
    shapes.append((2, 40_000))  # selected values over several parallel tasks (seeks)
    for shape in shapes:
        for density in (0.0, 0.05, 0.5, 1.0):
            x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            keep = torch.rand(*shape, generator=g) < density
            cases.append((f"{shape}@{density}", torch.where(keep, x, 0), keep))
    special = torch.relu(torch.randn(4, 100, generator=g, dtype=torch.float64)).to(dtype)
    special[0, :4] = torch.tensor([float("nan"), float("inf"), torch.finfo(dtype).max, 1e-3])
    cases.append(("special", special, special != 0))
    wide = torch.relu(torch.randn(3, 5000, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    cases.append(("wide", wide, wide != 0))
    nchw = torch.relu(torch.randn(2, 8, 6, 5, generator=g)).to(dtype)
    last = nchw.to(memory_format=torch.channels_last)
    cases.append(("channels-last", last, last != 0))
    cases.append(("transposed", nchw[0, 0].t(), nchw[0, 0].t() != 0))
    return cases
