"""ChannelScaled: outlier channels kept apart before quantization (power-of-two scales as
int8 exponents, the largest channels exact), exact where it claims to be, unbiased."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_KERNELS_TURNED_OFF

from actcore.compressors import ChannelScaled, Quantize
from actcore.compressors.channel_scaled import (
    channel_dim,
    exact_channels,
    joint_top,
    joint_top_and_amax,
    scaled,
)


def _tokens(outlier: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= outlier
    return x.to(dtype)


def test_without_outliers_it_packs_exactly_what_its_inner_packs() -> None:
    x = _tokens()
    inner = Quantize(2, 256, per_sample=False, stochastic=False)
    tensors, meta = ChannelScaled(inner).pack(x)
    plain, _ = inner.pack(x)
    exponents = tensors[meta[1]]
    assert exponents.dtype == torch.int8 and exponents.numel() == 96
    assert not exponents.any()  # every channel within 4x of the median: divided by 2**0
    assert all(torch.equal(a, b) for a, b in zip(tensors[: meta[1]], plain, strict=True))


def test_an_outlier_channel_is_divided_by_a_power_of_two_and_restored() -> None:
    x = _tokens(outlier=200.0)
    inner = Quantize(4, 256, per_sample=False, stochastic=False)
    comp = ChannelScaled(inner)
    tensors, meta = comp.pack(x)
    exponents = tensors[meta[1]].flatten()
    assert exponents[5] >= 5 and int((exponents != 0).sum()) == 1  # 200x / (4x median)
    restored = comp.unpack(tensors, meta)
    others = [c for c in range(96) if c != 5]
    err_scaled = (restored[:, others] - x[:, others]).abs().max()
    err_plain = (inner.unpack(*inner.pack(x))[:, others] - x[:, others]).abs().max()
    assert err_scaled < err_plain / 10  # the outlier no longer sets its neighbours' step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_exact_channels_come_back_bitwise(dtype: torch.dtype) -> None:
    x = _tokens(outlier=200.0, dtype=dtype)
    comp = ChannelScaled(Quantize(2, 256, per_sample=False), exact=2)
    restored = comp.unpack(*comp.pack(x))
    assert restored.dtype == dtype
    assert torch.equal(restored[:, 5], x[:, 5])  # the largest channel, kept as it is
    given = ChannelScaled(Quantize(2, 256, per_sample=False), exact=2, top=torch.tensor([1, 7]))
    restored = given.unpack(*given.pack(x))
    assert torch.equal(restored[:, [1, 7]], x[:, [1, 7]])
    assert given.key() != comp.key()  # packs differently: never shared with the other


@pytest.mark.parametrize("exact", [0, 1])
def test_a_scale_past_fp16_range_is_capped_not_infinite(exact: int) -> None:
    """A channel 2**20 times the bound would need a divisor fp16 cannot hold (its largest
    power of two is 2**15): the exponent is capped, the values stay finite and close."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.01
    x[:, 5] = 60000.0
    x[:, 9] = 30000.0
    x = x.half()
    comp = ChannelScaled(Quantize(8, 256, per_sample=False), exact=exact)
    tensors, meta = comp.pack(x)
    assert int(tensors[meta[1]].max()) == 15
    restored = comp.unpack(tensors, meta)
    assert torch.isfinite(restored).all()
    assert (restored.float() - x.float()).abs().max() <= 60000.0 / 255 * 2


def test_rounding_stays_unbiased_through_the_scales() -> None:
    """Mean of 400 stochastic roundings: within 4 standard errors of x everywhere, the
    bound from each element's rounding variance (at most step^2 / 4)."""
    x = _tokens(outlier=200.0)
    comp = ChannelScaled(Quantize(2, 256, per_sample=False))
    n = 400
    total = torch.zeros_like(x)
    for _ in range(n):
        total += comp.unpack(*comp.pack(x))
    tensors, meta = comp.pack(x)
    scale = torch.exp2(tensors[meta[1]].float())  # per channel, broadcast over rows
    step = (x / scale).abs().max() * 2 / 3 * scale  # a group's range over 3 levels, at most
    assert ((total / n - x).abs() <= 4 * step / 2 / n**0.5).all()


def test_joint_top_picks_the_dims_whose_product_moves_most() -> None:
    q, k = torch.randn(2, 4, 32, 16), torch.randn(2, 4, 32, 16)
    q[:, 0, :, 3] *= 200  # an outlier dim in q only: k's error there is multiplied by it
    k[:, :, :, 9] *= 3
    assert joint_top(q, k, -1, 1).tolist() == [3]
    assert sorted(joint_top(q, k, -1, 2).tolist()) == [3, 9]


def test_packing_with_the_amax_joint_top_found_is_the_same() -> None:
    """q and k packed with the channel magnitudes joint_top read (attention hands them over,
    so neither is read again) store exactly what packing them from scratch stores."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 3, 40, 3 * 32, generator=g)
    qkv[..., 7] *= 50  # an outlier feature of q
    q, k = qkv[..., :32], qkv[..., 32:64]  # strided views, as heads sliced from qkv
    top, amax_q, amax_k = joint_top_and_amax(q, k, -1, 2)
    assert torch.equal(top, joint_top(q, k, -1, 2))
    for x, amax in ((q, amax_q), (k, amax_k)):
        inner = Quantize(4, 64, stochastic=False)  # (deterministic: the packs compare)
        plain = ChannelScaled(inner, -1, exact=2, top=top)
        given = ChannelScaled(inner, -1, exact=2, top=top, amax=amax)
        a, meta_a = plain.pack(x)
        b, meta_b = given.pack(x)
        assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
        assert torch.equal(given.unpack(b, meta_b), plain.unpack(a, meta_a))


def _views() -> list[tuple[torch.Tensor, int]]:
    """Layouts a channel reduction meets: q's heads sliced from a fused qkv projection, a
    transposed and an expanded tensor, NCHW and channels-last maps, a column slice."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 10, 3 * 24, generator=g)
    q = qkv[..., :24].view(3, 10, 4, 6).transpose(1, 2)
    maps = torch.randn(2, 5, 7, 3, generator=g)
    return [
        (q, 3),
        (q, 1),
        (torch.randn(6, 8, generator=g).t(), 1),
        (torch.randn(1, 5, 1, generator=g).expand(4, 5, 3), 1),
        (maps, 1),
        (maps.contiguous(memory_format=torch.channels_last)[:, :, 1:], 1),
        (torch.randn(9, 12, generator=g)[:, 2:9], 1),
        (qkv.bfloat16()[..., :24].view(3, 10, 4, 6).transpose(1, 2), 3),  # (strided too)
    ]


@pytest.mark.parametrize("case", range(8))
def test_channel_magnitudes_of_strided_views_are_exact(case: int) -> None:
    from actcore.compressors.channel_scaled import _channel_amax

    x, dim = _views()[case]
    others = [d for d in range(x.dim()) if d != dim]
    expected = x.float().abs().amax(dim=others, keepdim=True)
    assert torch.equal(_channel_amax(x, dim), expected)
    assert torch.equal(_channel_amax(x.contiguous(), dim), expected)


def test_where_groups_mix_channels() -> None:
    assert channel_dim(torch.zeros(8, 64), 256) == -1
    assert channel_dim(torch.zeros(2, 8, 64), 256) == -1
    assert channel_dim(torch.zeros(2, 16, 7, 7), 256) == 1  # 49 values per channel
    assert channel_dim(torch.zeros(2, 16, 16, 16), 256) is None  # groups inside a channel
    assert exact_channels(64) == 1 and exact_channels(257) == 2
    inner = Quantize(2)
    assert scaled(inner, torch.zeros(2, 16, 16, 16), 256) is inner
    assert scaled(inner, torch.zeros(8, 64), 256, exact=True).exact == 1


def test_a_layer_reuses_its_scales_until_a_refresh() -> None:
    """ChannelScales finds the exponents on a refresh or a new layout and hands out copies of
    them in between (no reductions over the tensor there); a packing's exponents never
    change afterwards; float16 always finds its own."""
    from actcore.compressors.channel_scaled import ChannelScales, channel_exponents

    x = _tokens(outlier=200.0)
    scales = ChannelScales()
    first = scales.exponents_for(x, 1, refresh=False)  # none yet: found
    assert first is not None and torch.equal(first, channel_exponents(x, 1))
    moved = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    moved[:, 40] *= 300.0  # the outlier in another channel
    reused = scales.exponents_for(moved, 1, refresh=False)
    assert reused is not first and torch.equal(reused, first)  # a copy of the kept ones
    again = scales.exponents_for(moved, 1, refresh=True)
    assert torch.equal(again, channel_exponents(moved, 1)) and not torch.equal(again, first)
    assert torch.equal(first, channel_exponents(x, 1))  # an earlier packing keeps its own
    assert torch.equal(scales.exponents_for(x, 1, refresh=False), again)
    assert scales.exponents_for(x[:, :50], 1, refresh=False).shape == (1, 50)  # other channels
    assert scales.exponents_for(x.double(), 1, refresh=False).shape == (1, 96)  # other dtype
    assert scales.exponents_for(x.half(), 1, refresh=True) is None


def test_exact_channels_are_reused_with_the_scales_and_stay_exact() -> None:
    """With exact channels, ChannelScales keeps their indices beside the exponents: reused
    (copies) until a refresh, found again then; a packing with reused ones still restores
    the channels it keeps exact bit for bit, though the outlier has moved since."""
    from actcore.compressors.channel_scaled import ChannelScales, found_scales

    x = _tokens(outlier=200.0)
    scales = ChannelScales()
    exponents, top = scales.scales_for(x, 1, refresh=False, exact=1)
    want_e, want_top = found_scales(x, 1, 4.0, 1)
    assert torch.equal(exponents, want_e) and torch.equal(top, want_top) and top.tolist() == [5]
    moved = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    moved[:, 40] *= 300.0
    e2, top2 = scales.scales_for(moved, 1, refresh=False, exact=1)
    assert top2 is not top and torch.equal(top2, top) and torch.equal(e2, exponents)
    comp = scaled(Quantize(2, 256, per_sample=False), moved, 256, True, 1, scales, False)
    assert comp.exact == 1 and comp.scales is scales  # (the packing asks them)
    tensors, meta = comp.pack(moved)
    assert torch.equal(tensors[-1], top) and torch.equal(tensors[-3], exponents)
    back = comp.unpack(tensors, meta)
    assert torch.equal(back[:, 5], moved[:, 5])  # the kept channel, exact though not largest
    assert torch.isfinite(back).all()
    e3, top3 = scales.scales_for(moved, 1, refresh=True, exact=1)
    assert top3.tolist() == [40] and torch.equal(e3, found_scales(moved, 1, 4.0, 1)[0])
    assert torch.equal(top, want_top) and torch.equal(e2, want_e)  # earlier copies unchanged
    assert scales.scales_for(moved, 1, refresh=False, exact=2)[1].numel() == 2  # new count


def test_stale_scales_keep_the_rounding_unbiased() -> None:
    """Exponents found on another step's values (here the outlier moved to another channel):
    the mean of 400 stochastic roundings is within 4 standard errors of x everywhere."""
    from actcore.compressors.channel_scaled import channel_exponents

    old = _tokens(outlier=200.0)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    x[:, 40] *= 300.0
    exponents = channel_exponents(old, 1)
    comp = ChannelScaled(Quantize(2, 256, per_sample=False), exponents=exponents)
    n = 400
    total = torch.zeros_like(x)
    for _ in range(n):
        tensors, meta = comp.pack(x)
        assert tensors[meta[1]] is exponents
        total += comp.unpack(tensors, meta)
    scale = torch.exp2(exponents.float())
    step = (x / scale).abs().max() * 2 / 3 * scale  # a group's range over 3 levels, at most
    assert ((total / n - x).abs() <= 4 * step / 2 / n**0.5).all()


def test_converted_linear_refreshes_on_the_schemes_statistics_steps() -> None:
    """In a converted model at the adaptive level the linears' input scales are found on the
    statistics steps only; the steps between reuse them."""
    import actcore
    from actcore.compressors import channel_scaled

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    actcore.convert(model, level="L3")
    scheme = model.act_adaptive
    scheme.interval = 5
    x = _tokens(outlier=200.0).requires_grad_()
    seen = []
    found = []
    original = channel_scaled.found_scales

    def counted(x, dim, ratio, exact, *args, **kwargs):
        if not exact:  # (the GELU's input keeps exact channels: found on every step)
            found.append(True)
        return original(x, dim, ratio, exact, *args, **kwargs)

    for _ in range(12):
        collecting = scheme.collecting()
        found.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(channel_scaled, "found_scales", counted)
            model(x).square().mean().backward()
        seen.append((collecting, len(found)))
    # one input packed: the second linear's is the GELU's output, rebuilt from the GELU's
    # own packing (scales are found by the packing, so nothing is found for it)
    assert all(count == (1 if collecting else 0) for collecting, count in seen), seen
    assert not all(c for c, _ in seen) and any(c for c, _ in seen[5:])


def test_a_converted_norm_reuses_its_exact_channels_between_refreshes() -> None:
    """A Q-layer whose input keeps exact channels (a layer norm's) finds its scales on its
    first use and every SCALES_REFRESH uses after, reusing them in between; the forward is
    the plain model's bit for bit on every step."""
    import copy

    import actcore
    from actcore.compressors import channel_scaled
    from actcore.compressors.channel_scaled import SCALES_REFRESH

    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        torch.nn.Linear(96, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 8)
    )
    model = copy.deepcopy(plain)
    actcore.convert(model, level="L3")
    x = _tokens(outlier=200.0)
    original = channel_scaled.found_scales
    exact_finds: list[int] = []

    def counted(x, dim, ratio, exact, *args, **kwargs):
        if exact:
            exact_finds.append(1)
        return original(x, dim, ratio, exact, *args, **kwargs)

    per_step = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(channel_scaled, "found_scales", counted)
        for _ in range(SCALES_REFRESH + 2):
            exact_finds.clear()
            out = model(x)
            assert torch.equal(out, plain(x))
            out.square().mean().backward()
            per_step.append(len(exact_finds))
    assert per_step == [1] + [0] * (SCALES_REFRESH - 1) + [1, 0]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.fixture(params=["kernels", "reference"])
def cpu_path(request):
    """The CPU kernels where this machine builds them, then the ops' pure-PyTorch references."""
    from actcore.native import loader

    before = loader.set_cpu_kernels(request.param == "kernels", warn=False)
    try:
        yield request.param
    finally:  # (not loaded before is not off: the default loads them on first use)
        loader.set_cpu_kernels(before or not CPU_KERNELS_TURNED_OFF, warn=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("shape", "dim"), [((4, 6, 9, 9), 1), ((3, 40, 24), -1)])
def test_one_pass_packing_is_that_of_the_divided_tensor(dtype, shape, dim, cpu_path):
    """Over Quantize, the scales are applied inside the quantize and dequantize passes
    (actcore::quantize_scaled): bit for bit what quantizing ``x / 2**e`` with the exact
    channels zeroed gives, restored as dequantizing times ``2**e`` does; with the CPU
    kernels and with the references."""
    from actcore import ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g).to(dtype)
    x.select(dim, 2).mul_(300)  # an outlier channel: scaled down
    x.select(dim, 4).fill_(float("inf"))  # the exact channel: kept apart, zero in the packing
    comp = ChannelScaled(Quantize(3, 64, per_sample=False), dim=dim, exact=1)
    ops.reset_seed_stream()
    tensors, meta = comp.pack(x)
    exponents, kept, top = tensors[3:]
    assert top.tolist() == [4] and int(exponents.flatten()[2]) > 0
    scale = torch.exp2(exponents.float()).to(dtype)
    divided = (x / scale).index_fill(dim, top, 0)
    ops.reset_seed_stream()
    want = ops.quantize(divided, 3, group_size=64, per_sample=False)
    for got, expected in zip(tensors[:3], want.tensors(), strict=True):
        assert torch.equal(got, expected)
    expected = (ops.dequantize(want) * scale).index_copy(dim, top, kept)
    restored = comp.unpack(tensors, meta)
    assert restored.dtype == dtype and torch.equal(restored, expected)
