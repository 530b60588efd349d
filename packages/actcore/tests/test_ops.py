"""Tests of actcore.ops: quantization, bit packing, masks and the noise hash."""

from __future__ import annotations

import math
import pickle
import re

import pytest
import torch

from actcore import ops
from actcore.ops import quantization

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# --- an independent oracle of the documented noise definition, in plain Python ints -------
def _mix32_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _uniform_py(seed: int, i: int) -> float:
    key = _mix32_py(_mix32_py((i >> 32) ^ (seed >> 32)) ^ (seed & 0xFFFFFFFF))
    return (_mix32_py((i & 0xFFFFFFFF) ^ key) >> 8) * 2.0**-24


def _groups(x: torch.Tensor, packed: ops.Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, step) of each element of x, broadcast from its group, in float64."""
    rows = packed.lo.shape[0]
    cols = x.numel() // rows if rows else 0
    col = torch.arange(cols) // packed.group_size
    lo = packed.lo.double()[:, col].reshape(x.shape)
    step = packed.step.double()[:, col].reshape(x.shape)
    return lo, step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_error_within_one_step(dtype, bits):
    torch.manual_seed(bits)
    x = (torch.randn(3, 5, 37) * 4 + 1).to(dtype)
    packed = ops.quantize(x, bits, group_size=64)
    y = ops.dequantize(packed)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    lo, step = _groups(x, packed)
    err = (y.double() - x.double()).abs()
    # one step, plus the rounding of the output to a narrow dtype (half an ulp of |y|)
    ulp = torch.finfo(dtype).eps * y.double().abs()
    assert torch.all(err <= step + ulp)
    # codes lie inside the group's range
    assert torch.all(y.double() >= lo - ulp) and torch.all(
        y.double() <= lo + step * (2**bits - 1) + ulp
    )


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_deterministic_rounding_is_within_half_a_step(bits):
    x = torch.randn(4, 300, dtype=torch.float64)
    packed = ops.quantize(x, bits, stochastic=False)
    _, step = _groups(x, packed)
    err = (ops.dequantize(packed) - x).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-9))


def test_codes_follow_the_documented_definition():
    """Every code is floor((x - lo) / step + u(seed, flat index)) with the documented hash."""
    torch.manual_seed(0)
    x = torch.randn(3, 50)
    seed = 0x1234_5678_9ABC
    packed = ops.quantize(x, 3, group_size=16, seed=seed)
    codes = ops.unpack_bits(packed.payload, 3, 3 * 56).view(3, 56)
    lo, step = _groups(x, packed)
    lo32, step32 = lo.float(), step.float()
    for n in range(3):
        for m in range(50):
            u = _uniform_py(seed, n * 50 + m)
            v = (x[n, m] - lo32[n, m]) / step32[n, m] + torch.tensor(u, dtype=torch.float32)
            expected = min(max(math.floor(v.item()), 0), 7)
            assert codes[n, m].item() == expected
        assert torch.all(codes[n, 50:] == 0)  # lanes past the end of a row are 0


def test_metadata_bounds_the_group():
    """lo is at most the group minimum, and lo + step * levels at least its maximum."""
    x = torch.randn(2, 1024) * 1e3 + 1e4
    g = x.view(2, 4, 256)
    mn, mx = g.amin(-1), g.amax(-1)
    for bits in (1, 2, 5):
        packed = ops.quantize(x, bits)
        lo, step = packed.lo.float(), packed.step.float()
        assert torch.all(lo <= mn)
        assert torch.all(lo.double() + step.double() * (2**bits - 1) >= mx.double())


def test_unbiased_over_seeds_within_theory():
    """Mean over S seeds deviates from x like a mean of Bernoulli(p) draws times the step."""
    torch.manual_seed(1)
    x = torch.randn(4, 512)
    S = 1500
    packed0 = ops.quantize(x, 2, seed=0)
    lo, step = _groups(x, packed0)
    total = torch.zeros_like(x, dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    for s in range(S):
        y = ops.dequantize(ops.quantize(x, 2, seed=s)).double()
        total += y
        total_sq += y * y
    mean = total / S
    p = ((x.double() - lo) / step).frac()
    var = p * (1 - p) * step**2  # variance of one stochastic rounding
    live = var > 0
    z = (mean - x.double())[live] / (var[live] / S).sqrt()
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs((z**2).mean().item() - 1) < 5 * math.sqrt(2 / n)
    assert z.abs().max().item() < 6
    assert torch.all((mean - x.double())[~live].abs() < 1e-6)

    # variance of the rounding is p(1-p) step^2: compare the sums, with the spread of a
    # sum of sample variances (fourth moment of a scaled Bernoulli) as the tolerance
    sample_var = (total_sq / S - mean**2) * S / (S - 1)
    mu4 = p * (1 - p) * (1 - 3 * p + 3 * p**2) * step**4
    spread = ((mu4 - var**2).clamp_min(0).sum() / S).sqrt()
    assert abs(sample_var.sum() - var.sum()) < 6 * spread + 1e-9


def test_noise_is_uniform_and_independent_across_seeds():
    index = torch.arange(1 << 20, dtype=torch.int64)
    u1 = ops.hash_uniform(index, 1).double()
    u2 = ops.hash_uniform(index, 2).double()
    n = index.numel()
    assert u1.min() >= 0 and u1.max() < 1
    assert abs(u1.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u1.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u1, bins=64, min=0, max=1)
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)  # chi-square with 63 degrees of freedom
    for a, b in ((u1, u2), (u1[:-1], u1[1:])):  # across seeds, and neighbours in one seed
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(n)


def test_hash_matches_oracle_on_64bit_indices():
    """Index math is 64-bit: indices past 2**31 and 2**32, and across a 2**32 boundary."""
    starts = [0, 2**31 - 3, 2**32 - 3, 2**40 + 7, 2**62]
    index = torch.tensor([s + k for s in starts for k in range(6)], dtype=torch.int64)
    for seed in (0, 1, 2**40 + 3, 2**63 - 1):
        got = ops.hash_uniform(index, seed)
        want = torch.tensor([_uniform_py(seed, int(i)) for i in index], dtype=torch.float32)
        assert torch.equal(got, want)
    # the upper word matters: index i and i + 2**32 get different noise
    lo = torch.arange(1000, dtype=torch.int64)
    assert not torch.equal(ops.hash_uniform(lo, 3), ops.hash_uniform(lo + 2**32, 3))


def test_shapes_of_a_tensor_past_2_31_elements_without_allocating_it():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 2**31 + 5, dtype=torch.bfloat16)
        payload, lo, step = torch.ops.actcore.quantize(x, 3, 256, True, 1, True)
        assert payload.shape == (3, (2**31 + 5 + 7) // 8 * 3)
        assert lo.shape == step.shape == (3, -(-(2**31 + 5) // 256))
        y = torch.ops.actcore.dequantize(payload, lo, step, 3, 256, [3, 2**31 + 5], x.dtype, True)
        assert y.shape == x.shape and y.dtype == torch.bfloat16


def _whole_and_tiled(monkeypatch, x, bits: int, group_size: int, seed: int, block: int):
    """``ops.quantize(x, ...)`` in one block, then in blocks of ``block`` elements; asserts
    both hold the same tensors and returns both."""
    whole = ops.quantize(x, bits, group_size=group_size, seed=seed)
    monkeypatch.setattr(quantization, "BLOCK_ELEMENTS", block)
    tiled = ops.quantize(x, bits, group_size=group_size, seed=seed)
    for a, b in zip(whole.tensors(), tiled.tensors(), strict=True):
        assert torch.equal(a, b)
    return whole, tiled


def test_blocked_processing_equals_one_block(monkeypatch):
    """Rows longer than a block are cut into column tiles: the result must not change."""
    torch.manual_seed(2)
    x = torch.randn(3, 5000)
    whole, tiled = _whole_and_tiled(monkeypatch, x, 3, group_size=64, seed=9, block=256)
    assert torch.equal(ops.dequantize(tiled), ops.dequantize(whole))


def test_row_tiles_equal_one_block(monkeypatch):
    x = torch.randn(50, 30)
    _whole_and_tiled(monkeypatch, x, 2, group_size=8, seed=4, block=100)


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_exact_byte_counts(bits):
    x = torch.randn(8, 3, 20, 20)  # 1200 elements per sample: 5 groups, the last partial
    packed = ops.quantize(x, bits)
    assert packed.payload.numel() == 8 * 1200 * bits // 8
    assert packed.lo.numel() == packed.step.numel() == 8 * 5
    assert packed.nbytes == 8 * 1200 * bits // 8 + 2 * 2 * 8 * 5
    assert packed.lo.dtype == packed.step.dtype == torch.bfloat16


def test_two_bits_cost_2_125_bits_per_element_and_15x_over_fp32():
    x = torch.randn(16, 64, 32, 32)
    packed = ops.quantize(x, 2)
    assert packed.bits_per_element == pytest.approx(2.125)
    assert x.nbytes / packed.nbytes >= 15


def test_same_seed_same_output_and_different_seeds_differ():
    x = torch.randn(4, 1000)
    a, b = ops.quantize(x, 2, seed=7), ops.quantize(x, 2, seed=7)
    assert all(torch.equal(s, t) for s, t in zip(a.tensors(), b.tensors(), strict=True))
    c = ops.quantize(x, 2, seed=8)
    assert not torch.equal(a.payload, c.payload)
    torch.manual_seed(5)
    ops.reset_seed_stream()
    d = ops.quantize(x, 2)
    ops.reset_seed_stream()
    e = ops.quantize(x, 2)
    assert torch.equal(d.payload, e.payload)  # seed=None: a reproducible stream
    f = ops.quantize(x, 2)
    assert not torch.equal(e.payload, f.payload)  # and each call gets a new seed
    torch.manual_seed(6)
    assert not torch.equal(ops.quantize(x, 2).payload, d.payload)  # keyed by the torch seed


def test_drawing_seeds_leaves_torch_random_stream_alone():
    torch.manual_seed(6)
    expected = torch.rand(5)
    torch.manual_seed(6)
    ops.quantize(torch.randn(2, 10, generator=torch.Generator().manual_seed(0)), 2)
    assert torch.equal(torch.rand(5), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_give_the_contiguous_result(dtype):
    torch.manual_seed(3)
    x = torch.randn(4, 6, 10, 10).to(dtype)
    ref = ops.quantize(x, 4, seed=11)
    for view in (
        x.to(memory_format=torch.channels_last),
        x.transpose(2, 3).contiguous().transpose(2, 3),
        torch.randn(4, 6, 10, 20).to(dtype)[..., ::2].copy_(x),
    ):
        assert not view.is_contiguous()
        got = ops.quantize(view, 4, seed=11)
        assert all(torch.equal(s, t) for s, t in zip(ref.tensors(), got.tensors(), strict=True))
        assert torch.equal(ops.dequantize(got), ops.dequantize(ref))


@pytest.mark.parametrize(
    "shape", [(), (0,), (0, 5), (5, 0), (1,), (7,), (3, 1), (2, 3, 5), (1, 257), (9, 8)]
)
@pytest.mark.parametrize("per_sample", [True, False])
def test_odd_shapes(shape, per_sample):
    x = torch.randn(shape)
    packed = ops.quantize(x, 3, per_sample=per_sample, group_size=16)
    y = ops.dequantize(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    rows, cols = (x.shape[0], math.prod(x.shape[1:])) if per_sample and x.dim() else (1, x.numel())
    assert packed.lo.shape == (rows, -(-cols // 16))
    assert packed.payload.shape == (rows, -(-cols // 8) * 3)
    if x.numel():
        _, step = _groups(x.reshape(rows, -1), packed)
        assert torch.all((y - x).abs().reshape(rows, -1) <= step.float())


def test_constant_groups_of_a_bf16_value_are_exact():
    """A constant group whose value bfloat16 holds exactly has step 0 and no error."""
    for value in (0.0, 0.5, -3.0, 1024.0):
        x = torch.full((2, 300), value)
        packed = ops.quantize(x, 1)
        assert torch.all(packed.step == 0)
        assert torch.equal(ops.dequantize(packed), x)


def test_nan_and_inf_poison_their_group_only():
    x = torch.randn(2, 512)
    x[0, 3] = float("nan")
    x[1, 300] = float("inf")
    x[1, 10] = -float("inf")
    y = ops.dequantize(ops.quantize(x, 4))
    assert torch.isnan(y[0, :256]).all()  # the group holding the NaN
    assert torch.isnan(y[1, :256]).all() and torch.isnan(y[1, 256:]).all()
    assert torch.isfinite(y[0, 256:]).all()  # a clean group stays finite and close
    assert (y[0, 256:] - x[0, 256:]).abs().max() < 1


def test_per_sample_groups_do_not_cross_samples():
    x = torch.cat([torch.zeros(1, 100), torch.full((1, 100), 1e4)])
    y = ops.dequantize(ops.quantize(x, 2))
    assert torch.equal(y[0], x[0])  # sample 0's range is not widened by sample 1
    flat = ops.quantize(x, 2, per_sample=False, group_size=256)
    assert flat.lo.shape == (1, 1)


def test_packed_properties_pickle_and_to():
    x = torch.randn(4, 100, dtype=torch.float16)
    packed = ops.quantize(x, 4, seed=1)
    assert packed.shape == x.shape and packed.dtype == torch.float16 and packed.bits == 4
    assert packed.device == torch.device("cpu") and packed.numel == 400
    clone = pickle.loads(pickle.dumps(packed))
    assert torch.equal(ops.dequantize(clone), ops.dequantize(packed))
    assert packed.to("cpu") is packed
    assert packed.to(torch.device("meta")).payload.is_meta
    assert "bits=4" in repr(packed)


def test_masks_round_trip_at_one_bit():
    torch.manual_seed(4)
    for shape in [(0,), (1,), (7,), (8,), (3, 5, 11), (64, 64)]:
        mask = torch.rand(shape) > 0.5
        packed = ops.pack_mask(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-mask.numel() // 8)
        assert torch.equal(ops.unpack_mask(packed, shape), mask)
    lsb_first = ops.pack_mask(torch.tensor([True] + [False] * 6 + [True]))
    assert lsb_first.tolist() == [0b1000_0001]


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_round_trip_and_size(bits):
    values = torch.randint(0, 2**bits, (1001,), dtype=torch.uint8)
    packed = ops.pack_bits(values, bits)
    assert packed.numel() == 126 * bits
    assert torch.equal(ops.unpack_bits(packed, bits, 1001), values)
    assert torch.equal(ops.unpack_bits(packed, bits, 10), values[:10])


@pytest.mark.parametrize("start", range(1, 8))
def test_bit_packing_of_unaligned_views(start):
    """A contiguous uint8 view whose data does not start on an 8-byte boundary."""
    base = torch.randint(0, 4, (start + 16,), dtype=torch.uint8)
    view = base[start : start + 16]
    assert torch.equal(ops.unpack_bits(ops.pack_bits(view, 2), 2, 16), view)
    mask = base.bool()[start : start + 16]
    assert torch.equal(ops.unpack_mask(ops.pack_mask(mask), (16,)), mask)


def test_bit_plane_layout():
    values = torch.tensor([1, 2, 3, 0, 0, 0, 0, 2], dtype=torch.uint8)
    # byte j holds bit j of the 8 values, value t in bit t
    assert ops.pack_bits(values, 2).tolist() == [0b0000_0101, 0b1000_0110]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"bits": 0}, ValueError, "bits must be in 1..8, got 0"),
        ({"bits": 9}, ValueError, "got 9"),
        ({"bits": 2.0}, TypeError, "bits must be an int"),
        ({"bits": True}, TypeError, "bits must be an int"),
        ({"bits": 2, "group_size": 12}, ValueError, "positive multiple of 8, got 12"),
        ({"bits": 2, "group_size": 0}, ValueError, "positive multiple of 8, got 0"),
        ({"bits": 2, "group_size": -8}, ValueError, "got -8"),
        ({"bits": 2, "seed": -1}, ValueError, "seed must be in [0, 2**63)"),
        ({"bits": 2, "seed": 2**63}, ValueError, "seed must be in"),
        ({"bits": 2, "seed": "a"}, TypeError, "seed must be an int"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        ops.quantize(torch.randn(4, 4), **kwargs)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64]
)
def test_non_float_input_is_refused(dtype):
    with pytest.raises(TypeError, match=f"got {dtype}"):
        ops.quantize(torch.zeros(4, dtype=dtype), 2)


def test_other_bad_inputs():
    with pytest.raises(TypeError, match=r"expects a torch\.Tensor"):
        ops.quantize([1.0, 2.0], 2)
    with pytest.raises(TypeError, match="expects a Packed"):
        ops.dequantize(torch.zeros(3))
    with pytest.raises(TypeError, match="bool tensor"):
        ops.pack_mask(torch.zeros(3))
    with pytest.raises(TypeError, match="uint8 values"):
        ops.pack_bits(torch.zeros(3), 2)
    with pytest.raises(ValueError, match="holds at most 8 values"):
        ops.unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, 9)
    with pytest.raises(TypeError, match="int64 indices"):
        ops.hash_uniform(torch.zeros(3, dtype=torch.int32), 1)


def test_input_requiring_grad_is_fine_and_untouched():
    x = torch.randn(3, 40, requires_grad=True)
    before = x.detach().clone()
    y = ops.dequantize(ops.quantize(x, 8))
    assert not y.requires_grad and torch.equal(x.detach(), before)


def _opcheck_cases():
    x = torch.randn(3, 70)
    payload, lo, step = torch.ops.actcore.quantize(x, 3, 32, True, 5, True)
    values = torch.randint(0, 8, (37,), dtype=torch.uint8)
    return [
        (torch.ops.actcore.quantize.default, (x, 3, 32, True, 5, True)),
        (torch.ops.actcore.quantize.default, (x.half().t(), 2, 8, False, 0, False)),
        (torch.ops.actcore.dequantize.default, (payload, lo, step, 3, 32, [3, 70], x.dtype, True)),
        (torch.ops.actcore.pack_bits.default, (values, 3)),
        (torch.ops.actcore.unpack_bits.default, (torch.ops.actcore.pack_bits(values, 3), 3, 37)),
        (torch.ops.actcore.hash_uniform.default, (torch.arange(100), 17)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_torch_compile_traces_the_ops():
    def round_trip(x):
        return ops.dequantize(ops.quantize(x, 2, seed=123)) * 2

    x = torch.randn(4, 300)
    compiled = torch.compile(round_trip, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), round_trip(x))
