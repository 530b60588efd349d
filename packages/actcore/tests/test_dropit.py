"""Tests of actcore.dropit's layers: exact forward and input gradients, min-k weight
gradients against a masked reference, the kept positions' encoding, dtypes and layouts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import converted, grads, rand, topk_mask
from torch import Tensor, nn

from actcore.dropit import (
    DropITConv1d,
    DropITConv2d,
    DropITLinear,
    drop_mink,
    num_kept,
    to_dropit,
)

F32 = 4


def masked(x: Tensor, gamma: float) -> Tensor:
    """``x`` with all but its k largest magnitudes zeroed (per tensor).

    Without ties at the threshold this is the independent :func:`topk_mask`. With ties (e.g.
    reflect padding copies elements) which tied copies survive is topk's choice, so the result
    is ``drop_mink``'s, checked to be a valid min-k selection.
    """
    mask = topk_mask(x, gamma)
    k = num_kept(x.numel(), gamma)
    if mask.sum() == k:
        return x * mask
    kept = drop_mink(x, gamma).restore()
    assert ((kept == x) | (kept == 0)).all()
    survivors = kept != 0
    assert survivors.sum() <= k
    assert kept.abs().max() == x.abs().max()
    assert x[~survivors].abs().max() <= kept[survivors].abs().min()
    return kept


# --------------------------------------------------------------------------------------------
# Layer semantics
# --------------------------------------------------------------------------------------------


LINEAR_CASES = [
    ((16, 32), True),
    ((16, 32), False),
    ((4, 5, 32), True),
    ((32,), True),
]
CONV_CASES = [
    (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3), (3, 4, 20)),
    (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=4, padding="same"), (2, 4, 15)),
    (nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=3, padding_mode="circular",
                     padding=2, groups=4), (2, 4, 12)),
    (nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1,
                     groups=2, bias=False), (2, 4, 9, 9)),
    (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(3, 2), dilation=(2, 1),
                     padding=(1, 2), padding_mode="reflect"), (2, 3, 10, 8)),
    (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=2, padding="same",
                     dilation=3), (3, 7, 6)),  # unbatched
    (nn.Conv3d, dict(in_channels=2, out_channels=4, kernel_size=3, stride=(1, 2, 1),
                     padding=1), (2, 2, 5, 6, 5)),
]  # fmt: skip


def explicit_padding(conv: nn.Module, x: Tensor) -> tuple[nn.Module, Tensor]:
    """The padding torch applies to a conv's input before convolving (non-zero padding modes
    and the odd extra of padding='same'); DropIT sees that padded input. Returns the conv to
    apply to the padded input, and the padded input."""
    ref = copy.deepcopy(conv)
    dims = conv.weight.dim() - 2
    if conv.padding_mode != "zeros":
        ref.padding_mode, ref.padding = "zeros", (0,) * dims
        return ref, F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
    if conv.padding == "same":
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
        ref.padding = tuple(t // 2 for t in totals)
        right = [p for t in reversed(totals) for p in (0, t % 2)]
        return ref, F.pad(x, right)
    return ref, x


def check_layer(plain: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, gamma: float) -> None:
    """Forward/input/bias grads identical to the plain layer; weight grad from the masked x."""
    plain = plain.to(dtype)
    drop = converted(plain, gamma)
    torch.manual_seed(1)
    x = rand(*shape, dtype=dtype)
    with torch.no_grad():
        g = torch.randn(plain(x).shape).to(dtype)
    out_ref, g_ref = grads(plain, x, g)
    out, g_drop = grads(drop, x, g)
    assert out.dtype == dtype
    assert torch.equal(out, out_ref)
    assert torch.equal(g_drop[0], g_ref[0])  # input gradient: bitwise
    if plain.bias is not None:
        assert torch.equal(g_drop[2], g_ref[2])
    # weight gradient: the plain layer's, computed on the input with the dropped part zeroed
    ref, padded = explicit_padding(plain, x) if not isinstance(plain, nn.Linear) else (plain, x)
    _, g_masked = grads(ref, masked(padded, gamma), g)
    assert torch.equal(g_drop[1], g_masked[1])
    assert not torch.equal(g_drop[1], g_ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "bias"), LINEAR_CASES)
def test_linear_matches_plain_and_masked_reference(shape, bias, dtype):
    torch.manual_seed(0)
    check_layer(nn.Linear(32, 24, bias=bias), shape, dtype, gamma=0.9)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cls", "kwargs", "shape"), CONV_CASES)
def test_conv_matches_plain_and_masked_reference(cls, kwargs, shape, dtype):
    torch.manual_seed(0)
    check_layer(cls(**kwargs), shape, dtype, gamma=0.8)


def test_conv_channels_last_input():
    torch.manual_seed(0)
    plain = nn.Conv2d(8, 8, 3, padding=1)
    drop = converted(plain, 0.5)
    x = rand(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    g = rand(2, 8, 6, 6)
    out_ref, g_ref = grads(plain, x, g)
    out, g_drop = grads(drop, x, g)
    assert torch.equal(out, out_ref)
    assert torch.equal(g_drop[0], g_ref[0])
    _, g_masked = grads(plain, x * topk_mask(x, 0.5), g)
    torch.testing.assert_close(g_drop[1], g_masked[1], rtol=1e-5, atol=1e-5)


def test_gamma_zero_is_bitwise_plain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5))
    drop = copy.deepcopy(model)
    to_dropit(drop, gamma=0.0)
    x, g = rand(2, 3, 8, 8), rand(2, 5)
    out_ref, g_ref = grads(model, x, g)
    out, g_drop = grads(drop, x, g)
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g_drop, g_ref, strict=True))


@pytest.mark.parametrize(
    "plain",
    [nn.Linear(6, 5), nn.Conv1d(2, 3, 3, padding=1)],
    ids=["linear", "conv1d"],
)
def test_nothing_dropped_through_function_is_bitwise_plain(plain):
    # gamma > 0 but floor(gamma * numel) == 0: the DropIT Function runs and keeps everything
    torch.manual_seed(0)
    x = rand(2, 6) if isinstance(plain, nn.Linear) else rand(2, 2, 4)
    drop = converted(plain, gamma=0.01)
    with torch.no_grad():
        g = torch.randn(plain(x).shape)
    out_ref, g_ref = grads(plain, x, g)
    out, g_drop = grads(drop, x, g)
    assert out.grad_fn is not None and "DropIT" in type(out.grad_fn).__name__
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g_drop, g_ref, strict=True))


def test_mink_sample_keeps_the_fraction_of_every_sample():
    torch.manual_seed(0)
    x = rand(4, 50)
    x[0] *= 100  # under per-tensor min-k, sample 0 would take almost every kept slot
    kept = drop_mink(x, 0.9, rows=4).restore()
    assert ((kept != 0).sum(dim=1) == 5).all()
    assert torch.equal(kept != 0, topk_mask(x, 0.9, per_sample=True))
    whole = drop_mink(x, 0.9).restore()
    assert (whole != 0).sum() == 20 and (whole[0] != 0).sum() == 20

    plain = nn.Linear(50, 3)
    drop = converted(plain, 0.9, strategy="mink_sample")
    g = rand(4, 3)
    _, g_drop = grads(drop, x, g)
    _, g_masked = grads(plain, x * topk_mask(x, 0.9, per_sample=True), g)
    assert torch.equal(g_drop[1], g_masked[1])


@pytest.mark.parametrize("strategy", ["mink", "mink_sample"])
def test_empty_batch(strategy):
    layer = DropITConv1d(2, 3, 3, gamma=0.9, strategy=strategy)
    x = torch.zeros(0, 2, 8, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 3, 6)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.weight.grad, torch.zeros(3, 2, 3))


def test_exactly_k_kept_with_ties_and_rounding():
    assert num_kept(100, 0.29) == 71
    assert num_kept(10, 0.9) == 1
    assert num_kept(3, 0.9) == 1  # never drops everything
    assert num_kept(7, 0.0) == 7
    x = torch.ones(3, 40)
    kept = drop_mink(x, 0.75)
    assert kept.values.numel() == 30
    assert (kept.restore() != 0).sum() == 30


@pytest.mark.parametrize(
    ("shape", "gamma", "encoding", "index_dtype", "index_bytes"),
    [
        ((64, 128), 0.9, "bitmap", torch.uint8, 8192 // 8),
        ((16, 100), 0.99, "int16", torch.int16, 16 * 2),  # 16 kept of 1600
        ((2, 40000), 0.99, "int32", torch.int32, 800 * 4),  # too long for int16 offsets
        ((2, 40000), 0.95, "bitmap", torch.uint8, 80000 // 8),
    ],
)
def test_cheapest_position_encoding_and_roundtrip(shape, gamma, encoding, index_dtype, index_bytes):
    torch.manual_seed(0)
    x = rand(*shape)
    kept = drop_mink(x, gamma)
    assert kept.encoding == encoding
    assert kept.index is not None and kept.index.dtype == index_dtype
    assert kept.values.dtype == x.dtype
    assert kept.index.numel() * kept.index.element_size() == index_bytes
    assert kept.nbytes == num_kept(x.numel(), gamma) * F32 + index_bytes
    mask = topk_mask(x, gamma)
    assert torch.equal(kept.restore(), x * mask)


def test_saved_tensors_have_no_int64():
    torch.manual_seed(0)
    cases = [
        (DropITLinear(128, 8, gamma=0.9), rand(64, 128)),
        (DropITLinear(64, 8, gamma=0.99), rand(32, 64)),  # int16 offsets
        (DropITConv2d(4, 4, 3, gamma=0.9, strategy="mink_sample"), rand(2, 4, 8, 8)),
    ]
    for layer, x in cases:
        out = layer(x.requires_grad_())
        dtypes = [t.dtype for t in out.grad_fn.saved_tensors]
        assert torch.int64 not in dtypes, dtypes
        assert dtypes[0] == torch.float32 and dtypes[-1] in (torch.uint8, torch.int16)


def test_frozen_weight_saves_no_input_and_no_grad_is_plain():
    layer = DropITLinear(32, 8)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = rand(16, 32).requires_grad_()
    out = layer(x)
    assert len(out.grad_fn.saved_tensors) == 1  # the weight only
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(16, 8) @ layer.weight)
    with torch.no_grad():
        assert layer(x).grad_fn is None
    assert nn.Linear.forward(layer, x).grad_fn is not None


def test_autocast_bf16_matches_plain():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 16, 5))
    drop = copy.deepcopy(plain)
    to_dropit(drop, gamma=0.5)
    x, g = rand(2, 3, 6, 6), rand(2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, g_ref = grads(plain, x, g)
        out, g_drop = grads(drop, x, g)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, out_ref)
    assert torch.equal(g_drop[0], g_ref[0])
    assert [t.dtype for t in g_drop] == [t.dtype for t in g_ref] == [torch.float32] * 5
