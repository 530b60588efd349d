"""Tests of actcore.dropit on models: the bytes it saves (and what it reports), conversion
with to_dropit / remove_dropit, and training that matches the baseline."""

from __future__ import annotations

import copy
import io
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import grads, rand, single_thread, topk_mask
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
    remove_dropit,
    to_dropit,
)
from actcore.dropit import modules as dropit_modules

F32 = 4


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
