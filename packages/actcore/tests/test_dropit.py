"""Tests of actcore.dropit: exact forward and input grads, min-k weight grads, bytes, conversion."""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcore import dropit, memory
from actcore.dropit import (
    DropITConv1d,
    DropITConv2d,
    DropITConv3d,
    DropITLinear,
    drop_mink,
    is_dropit,
    measure_saving,
    num_kept,
    remove_dropit,
    to_dropit,
)
from actcore.dropit import modules as dropit_modules

F32 = 4


def topk_mask(x: Tensor, gamma: float, per_sample: bool = False) -> Tensor:
    """Independent reference mask: elements at or above the k-th largest magnitude."""
    rows = x.shape[0] if per_sample else 1
    flat = x.detach().float().abs().reshape(rows, -1)
    k = flat.shape[1] - int(gamma * flat.shape[1] + 1e-6)
    threshold = flat.kthvalue(flat.shape[1] - k + 1, dim=1, keepdim=True).values
    return (flat >= threshold).reshape(x.shape)


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


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Random values whose magnitudes are all distinct in ``dtype`` (no ties to break)."""
    n = torch.Size(shape).numel()
    pool = torch.unique(torch.randn(8 * n + 64).to(dtype).abs())
    pool = pool[pool > 0]
    assert pool.numel() >= n
    values = pool[torch.randperm(pool.numel())[:n]]
    signs = torch.randint(0, 2, (n,)).to(dtype) * 2 - 1
    return (values * signs).reshape(shape)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grads(module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output and the grads of (input, *parameters) for upstream gradient ``g``."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    params = list(module.parameters())
    return out, list(torch.autograd.grad(out, [x, *params], g))


def converted(module: nn.Module, gamma: float = 0.9, strategy: str = "mink") -> nn.Module:
    new = copy.deepcopy(module)
    report = to_dropit(new, strategy, gamma)
    assert report.converted == [""]
    return new


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


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def test_mlp_keeps_at_most_a_quarter_of_the_dropped_bytes():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10))
    drop = copy.deepcopy(plain)
    to_dropit(drop, gamma=0.9)
    x = rand(64, 256)
    out_p, rep_p = memory.measure(plain, x)
    out_d, rep_d = memory.measure(drop, x)
    dropped = 64 * (256 + 512) * F32  # fp32 inputs of the two Linear layers
    assert rep_p.by_module["0"] + rep_p.by_module["2"] == dropped
    kept = rep_d.by_module["0"] + rep_d.by_module["2"]
    ratio = kept / dropped
    assert ratio <= 0.25
    assert ratio == pytest.approx((0.1 * F32 + 1 / 8) / F32, rel=1e-3)  # values + bitmap
    # a real saving: the whole model holds that much less, GELU's own input is untouched
    assert rep_p.retained_bytes - rep_d.retained_bytes == dropped - kept
    assert rep_p.by_module["1"] == rep_d.by_module["1"]
    saving = measure_saving(drop, x)
    assert saving.not_real == []
    assert saving.saved_bytes == dropped - kept
    assert saving.layers["2"].saving == 64 * 512 * F32 - rep_d.by_module["2"]
    del out_p, out_d


@pytest.mark.parametrize("inplace", [True, False])
def test_relu_aliasing_is_reported_not_claimed(inplace):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
        nn.Conv2d(8, 8, 3, padding=1),
    )  # fmt: skip
    x = rand(2, 3, 16, 16)
    plain = copy.deepcopy(model)
    stats = copy.deepcopy(model[1].state_dict())
    report = to_dropit(model, gamma=0.9, example_inputs=x)
    saving = report.saving
    assert saving is not None
    assert report.not_real == ["3"]
    second = saving.layers["3"]
    assert second.saving <= 0 and not second.real and "ReLU" in second.note
    assert second.kept_bytes > 0 and second.saving == -second.kept_bytes
    first = saving.layers["0"]
    assert first.real and first.saving == first.input_bytes - first.kept_bytes
    assert saving.saved_bytes == first.saving + second.saving
    assert "NOT REAL" in str(report)
    # the comparison runs left BatchNorm's running statistics as they were
    for key, value in model[1].state_dict().items():
        assert torch.equal(value, stats[key])
    # the plain/DropIT difference, measured independently
    _, rep_d = memory.measure(model, x)
    _, rep_p = memory.measure(plain, x)
    assert rep_p.retained_bytes - rep_d.retained_bytes == saving.saved_bytes

    again = to_dropit(model, gamma=0.9, example_inputs=x, revert_unreal=True)
    assert again.converted == ["0"]
    assert type(model[3]) is nn.Conv2d and is_dropit(model[0])
    assert "not real" in again.skipped["3"]
    assert again.saving is not None and again.not_real == []


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.used(x))


def test_uncalled_layer_is_reported_and_kept():
    model = Branchy()
    x = rand(4, 8)
    report = to_dropit(model, example_inputs=x, revert_unreal=True)
    assert report.saving is not None
    assert report.saving.not_called == ["unused"] and report.not_real == []
    assert report.converted == ["used", "unused"] and is_dropit(model.unused)
    assert report.saving.layers["used"].calls == 1 and report.saving.layers["used"].real
    assert "NOT CALLED" in str(report)
    assert "saving not measured" in str(to_dropit(Branchy()))


def test_resnet18_savings_are_only_claimed_where_real():
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10)
    x = rand(2, 3, 16, 16)
    with single_thread():  # ~45 small forwards: spare the shared cores
        report = to_dropit(model, gamma=0.9, example_inputs=x)
        again = to_dropit(model, gamma=0.9, example_inputs=x, revert_unreal=True)
    saving = report.saving
    assert saving is not None and len(report.converted) == 21
    # inputs that are not a ReLU's output: the image, the max-pool output, the pooled features
    real = ["conv1", "layer1.0.conv1", "fc"]
    assert sorted(set(report.converted) - set(saving.not_real)) == sorted(real)
    assert saving.layers["layer2.0.conv1"].group == ("layer2.0.conv1", "layer2.0.downsample.0")
    by_group = {layer.group: layer.saving for layer in saving.layers.values()}
    assert saving.saved_bytes == sum(by_group.values())  # the unreal ones cost bytes
    assert 0 < saving.saved_bytes < 0.05 * saving.plain_bytes
    assert again.converted == real
    assert again.saving is not None and again.saving.not_real == []
    assert again.saving.saved_bytes == sum(saving.layers[name].saving for name in real)


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Conv3d(1, 1, 1))
        self.body = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)
        self.attn = nn.MultiheadAttention(4, 1)  # out_proj: a Linear subclass


def test_swap_keeps_identity_parameters_and_state_dict():
    torch.manual_seed(0)
    model = Net().to(torch.float64)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    layer = model.body[1]
    report = to_dropit(model, gamma=0.5)
    assert report.converted == ["stem.0", "stem.2", "body.0", "body.1", "head"]
    assert report.skipped == {
        "attn.out_proj": "NonDynamicallyQuantizableLinear is a subclass of Linear "
        "(only exact classes are converted)"
    }
    assert model.body[1] is layer and type(layer) is DropITLinear
    assert isinstance(layer, nn.Linear)
    assert type(model.stem[0]) is DropITConv1d and type(model.stem[2]) is DropITConv3d
    assert type(model.body[0]) is DropITConv2d
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert "dropit=mink(gamma=0.5)" in repr(layer)
    plain = nn.Linear(4, 3).to(torch.float64)
    plain.load_state_dict(model.head.state_dict())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.head) is DropITLinear and loaded.head.dropit_gamma == 0.5


def test_skip_patterns_and_marks():
    model = Net()
    model.body.dropit_skip = True
    report = to_dropit(model, skip=("stem.2", "he*"))
    assert report.converted == ["stem.0"]
    assert report.skipped["stem.2"] == "name matches skip pattern 'stem.2'"
    assert report.skipped["head"] == "name matches skip pattern 'he*'"
    assert report.skipped["body.0"] == "inside skipped 'body': dropit_skip is set"
    assert report.skipped["body.1"] == "inside skipped 'body': dropit_skip is set"
    assert type(model.head) is nn.Linear and type(model.body[0]) is nn.Conv2d

    single = nn.Linear(2, 2)
    single.dropit_skip = True
    assert to_dropit(single).skipped == {"": "dropit_skip is set"}
    assert type(single) is nn.Linear


def test_idempotent_update_and_revert():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    first = to_dropit(model, gamma=0.9)
    x = rand(4, 8)
    out = model(x)
    second = to_dropit(model, gamma=0.9)
    assert first.converted == second.converted == ["0", "2"]
    assert type(model[0]) is DropITLinear and type(model[0]).__mro__.count(DropITLinear) == 1
    assert torch.equal(model(x), out)
    to_dropit(model, "mink_sample", 0.5)
    assert (model[2].dropit_strategy, model[2].dropit_gamma) == ("mink_sample", 0.5)
    third = to_dropit(model, skip="2")
    assert type(model[2]) is nn.Linear and "made plain again" in third.skipped["2"]
    assert not hasattr(model[2], "dropit_gamma")
    assert remove_dropit(model) == ["0"] and type(model[0]) is nn.Linear
    assert torch.equal(model(x), out)


def test_not_inplace_converts_a_copy():
    model = nn.Sequential(nn.Linear(3, 3))
    report = to_dropit(model, inplace=False)
    assert type(model[0]) is nn.Linear
    assert report.model is not model and type(report.model[0]) is DropITLinear


@pytest.mark.parametrize("gamma", [-0.1, 1.0, 1.5, float("nan"), True, "0.5", None])
def test_bad_gamma(gamma):
    with pytest.raises(ValueError, match=r"gamma must be a number in \[0, 1\)") as err:
        to_dropit(nn.Linear(2, 2), gamma=gamma)
    assert repr(gamma) in str(err.value)
    with pytest.raises(ValueError, match="gamma"):
        DropITLinear(2, 2, gamma=gamma)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown DropIT strategy 'topk'.*'mink', 'mink_sample'"):
        to_dropit(nn.Linear(2, 2), strategy="topk")
    with pytest.raises(TypeError, match=r"nn\.Module, got list"):
        to_dropit([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="skip must hold module-name patterns"):
        to_dropit(nn.Linear(2, 2), skip=[3])
    with pytest.raises(ValueError, match="revert_unreal=True needs example_inputs"):
        to_dropit(nn.Linear(2, 2), revert_unreal=True)
    with pytest.raises(ValueError, match=r"positive divisor of x\.numel\(\)=12, got 5"):
        drop_mink(torch.ones(12), 0.5, rows=5)
    with pytest.raises(ValueError, match="no DropIT layers"):
        measure_saving(nn.Linear(2, 2), torch.ones(1, 2))


def test_transformers_conv1d_only_when_loaded(monkeypatch):
    # without transformers loaded, conversion never imports it
    had = {name for name in sys.modules if name.split(".")[0] == "transformers"}
    to_dropit(nn.Sequential(nn.Linear(2, 2)))
    assert {name for name in sys.modules if name.split(".")[0] == "transformers"} == had

    class Conv1D(nn.Module):  # the layout of transformers.pytorch_utils.Conv1D
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
            self.bias = nn.Parameter(torch.randn(nf))

        def forward(self, x: Tensor) -> Tensor:
            size_out = (*x.size()[:-1], self.nf)
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)

    torch.manual_seed(0)
    plain = Conv1D(6, 16)
    model = nn.Sequential(copy.deepcopy(plain))
    assert to_dropit(model).converted == []  # not the transformers class: left alone
    assert type(model[0]) is Conv1D

    pkg = types.ModuleType("transformers")
    utils = types.ModuleType("transformers.pytorch_utils")
    utils.Conv1D = Conv1D
    monkeypatch.setitem(sys.modules, "transformers", pkg)
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", utils)
    monkeypatch.setattr(dropit_modules, "_HF_CLASSES", {})
    registered = "DropITConv1D" in vars(dropit_modules)  # by a real transformers Conv1D, if any
    try:
        report = to_dropit(model, gamma=0.75)
        if not registered:  # importable (and picklable) from the package by its name
            assert dropit.DropITConv1D is type(model[0])
    finally:  # forget the DropIT class made for this fake Conv1D
        if not registered:
            vars(dropit_modules).pop("DropITConv1D", None)
    assert report.converted == ["0"]
    layer = model[0]
    assert isinstance(layer, Conv1D) and is_dropit(layer)
    x, g = rand(2, 5, 16), rand(2, 5, 6)
    out_ref, g_ref = grads(plain, x, g)
    out, g_drop = grads(layer, x, g)
    assert torch.equal(out, out_ref)
    assert torch.equal(g_drop[0], g_ref[0]) and torch.equal(g_drop[2], g_ref[2])
    _, g_masked = grads(plain, x * topk_mask(x, 0.75), g)
    assert torch.equal(g_drop[1], g_masked[1])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def digits_accuracy(data: tuple[Tensor, ...], seed: int, gamma: float) -> float:
    xtr, ytr, xte, yte = data
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 16, 10),
    )  # fmt: skip
    if gamma:
        assert len(to_dropit(model, gamma=gamma).converted) == 3
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        perm = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(perm), 32):
            idx = perm[i : i + 32]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item() * 100


def test_digits_training_matches_baseline():
    datasets = pytest.importorskip("sklearn.datasets")
    selection = pytest.importorskip("sklearn.model_selection")
    x, y = datasets.load_digits(return_X_y=True)
    xtr, xte, ytr, yte = selection.train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    data = (
        torch.tensor(xtr / 16.0, dtype=torch.float32),
        torch.tensor(ytr),
        torch.tensor(xte / 16.0, dtype=torch.float32),
        torch.tensor(yte),
    )
    with single_thread():  # deterministic, and kind to the shared cores
        base = [digits_accuracy(data, seed, 0.0) for seed in range(3)]
        drop = [digits_accuracy(data, seed, 0.9) for seed in range(3)]
    print(f"digits accuracy baseline {base} DropIT(0.9) {drop}")
    assert min(base) > 90
    assert abs(sum(drop) / 3 - sum(base) / 3) <= 1.0, (base, drop)
