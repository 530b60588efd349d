"""actcore.convert / QModule: whole models keep their outputs, gradients and state_dict."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torchvision
from conftest import forward_backward
from torch import nn

import actcore
from actcore.config import LEVELS, config


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.LayerNorm(64),
        nn.GELU(),
        nn.Dropout(0.2, inplace=True),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(64, 5),
    )


def _step(model: nn.Module, x: torch.Tensor, seed: int = 11):
    """One seeded forward/backward; returns the output and every parameter's gradient."""
    out, grads = forward_backward(model, x, seed=seed, mean=True)
    return out, dict(zip((n for n, _ in model.named_parameters()), grads, strict=True))


@pytest.mark.parametrize("factory, shape", [(_resnet18, (2, 3, 32, 32)), (_mlp, (16, 32))])
def test_l0_outputs_and_all_gradients_bitwise(factory, shape) -> None:
    ref = factory()
    q = actcore.convert(copy.deepcopy(ref), level="L0")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out_ref, g_ref = _step(ref, x)
    out_q, g_q = _step(q, x)
    assert torch.equal(out_q, out_ref)
    assert g_ref.keys() == g_q.keys()
    for name in g_ref:
        assert torch.equal(g_q[name], g_ref[name]), name
    for (name, a), b in zip(ref.state_dict().items(), q.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # BN running statistics updated identically


@pytest.mark.parametrize("level", ["L1", "L2", "L3"])
@pytest.mark.parametrize("factory, shape", [(_resnet18, (4, 3, 64, 64)), (_mlp, (16, 32))])
def test_compressed_levels_same_forward(factory, shape, level: str) -> None:
    ref = factory()
    q = actcore.convert(copy.deepcopy(ref), level=level)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out_ref, g_ref = _step(ref, x)
    out_q, g_q = _step(q, x)
    assert torch.equal(out_q, out_ref)
    for name in g_ref:
        a, b = g_ref[name].flatten(), g_q[name].flatten()
        assert torch.isfinite(b).all()
        # at 4 bits the rounding noise (variance <= step^2 / 4, step = range / 15) is small
        # against the signal, so one step already points the same way; 2-bit gradients are
        # as noisy as they are large per step and are checked for bias in test_levels
        if level != "L3" and a.norm() > 0:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.5, name


def test_report_lists_converted_and_left() -> None:
    model = _resnet18()
    actcore.convert(model, level="L2")
    report = model.act_report
    assert report.level == "L2"
    expected = {
        name: f"Q{type(m).__name__}"
        for name, m in _resnet18().named_modules()
        if type(m) in (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.Linear)
    }
    assert report.converted == expected
    assert report.left == {}
    assert "converted" in str(report)


def test_idempotent_and_level_change() -> None:
    model = _resnet18()
    x = torch.randn(2, 3, 32, 32)
    actcore.convert(model, level="L2")
    first = dict(model.act_report.converted)
    classes = {n: type(m) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    actcore.convert(model, level="L3")
    assert model.act_report.converted == first
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert list(model.state_dict()) == keys
    assert all(m.act_level == "L3" for m in model.modules() if isinstance(m, actcore.QLayer))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), _resnet18().eval()(x))


def test_exclude_by_name_type_and_predicate() -> None:
    model = _mlp()
    actcore.convert(
        model,
        level="L2",
        exclude=("0", nn.LayerNorm, lambda name, m: isinstance(m, nn.Dropout) and m.p < 0.3),
    )
    report = model.act_report
    assert report.left == {"0": "excluded", "1": "excluded", "3": "excluded"}
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.LayerNorm
    assert type(model[3]) is nn.Dropout and type(model[6]) is actcore.QDropout
    assert set(report.converted) == {"4", "5", "6", "7"}  # 2: GELU, routed by the scope
    # fnmatch patterns over qualified names
    resnet = actcore.convert(_resnet18(), level="L2", exclude=("layer4.*",))
    assert all(not isinstance(m, actcore.QLayer) for m in resnet.layer4.modules())
    assert isinstance(resnet.layer3[0].conv1, actcore.QConv2d)


def test_unknown_level_lists_valid_ones() -> None:
    valid = "valid levels: " + ", ".join(LEVELS)
    assert valid.endswith("L0, L1, L2, L3, L3.1, L4, L5, swap")
    model = _mlp()
    for bad in ("L9", 3, "l3"):
        with pytest.raises(ValueError, match=re.escape(f"{bad!r}; {valid}")):
            actcore.convert(model, level=bad)
    assert not any(isinstance(m, actcore.QLayer) for m in model.modules())
    with pytest.raises(ValueError, match=re.escape(valid)):
        actcore.set_optimization_level("L7")


@pytest.mark.parametrize(
    "module, reason",
    [
        (nn.MaxPool2d(2, return_indices=True), "return_indices"),
        (nn.Conv2d(3, 3, 4, padding="same"), "padding='same'"),
        (nn.Conv1d(3, 3, 2, padding="same", dilation=3), "padding='same'"),
    ],
)
def test_unsupported_config_left_with_warning(module: nn.Module, reason: str) -> None:
    model = nn.Sequential(nn.Identity(), module)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=rf"left 1 unconverted: .*{re.escape(reason)}"):
        actcore.convert(model, level="L3")
    assert type(model[1]) is type(module)
    assert reason in model.act_report.left["1"]
    x = torch.randn(2, 3, 8, 8) if module.__class__ is not nn.Conv1d else torch.randn(2, 3, 9)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def test_supported_same_padding_converted_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = actcore.convert(nn.Sequential(nn.Conv2d(3, 3, 3, padding="same")), level="L3")
    assert isinstance(model[0], actcore.QConv2d)


def test_subclass_with_own_behaviour_left() -> None:
    class MyConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = actcore.convert(nn.Sequential(MyConv(3, 3, 1)), level="L2")
    assert type(model[0]) is MyConv
    assert "subclass of Conv2d" in model.act_report.left["0"]


def test_state_dict_round_trip() -> None:
    ref = _resnet18()
    q = actcore.convert(copy.deepcopy(ref), level="L3")
    x = torch.randn(2, 3, 32, 32)
    _step(q, x)  # update BN statistics of the converted model
    torch.optim.SGD(q.parameters(), lr=0.1).step()
    plain = torchvision.models.resnet18(num_classes=10)
    plain.load_state_dict(q.state_dict())  # strict: same keys
    for (k, a), b in zip(q.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    back = actcore.convert(torchvision.models.resnet18(num_classes=10), level="L3")
    back.load_state_dict(plain.state_dict())
    for (k, a), b in zip(q.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    q.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(q(x), plain(x))


def test_inplace_false_copies_and_keeps_original() -> None:
    model = _mlp()
    q = actcore.convert(model, level="L2", inplace=False)
    assert q is not model and type(model[0]) is nn.Linear and type(q[0]) is actcore.QLinear
    assert q.act_report.converted and not hasattr(model, "act_report")


def test_qmodule_uses_process_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "level", config.level)
    actcore.set_optimization_level("L1")
    model = actcore.QModule(_mlp())
    assert model.act_report.level == "L1"
    assert all(m.act_level == "L1" for m in model.modules() if isinstance(m, actcore.QLayer))


def test_convert_after_dtype_change() -> None:
    ref = _resnet18().to(torch.bfloat16)
    q = actcore.convert(copy.deepcopy(ref), level="L2")
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    out_ref, _ = _step(ref, x)
    out_q, g_q = _step(q, x)
    assert torch.equal(out_q, out_ref)
    assert all(g.dtype == torch.bfloat16 for g in g_q.values())


def test_register_q_layer_extends_convert() -> None:
    from actcore.layers import Q_LAYERS, QBatchNormBase, register_q_layer

    class AnyDimBN(nn.modules.batchnorm._BatchNorm):  # a library's own batch-norm class
        def _check_input_dim(self, input: torch.Tensor) -> None:
            pass

    class QAnyDimBN(QBatchNormBase, AnyDimBN):
        pass

    with pytest.raises(TypeError, match="must subclass both AnyDimBN and"):
        register_q_layer(AnyDimBN, actcore.QBatchNorm2d)
    with pytest.raises(TypeError, match=r"stock must be an nn\.Module class, got 3"):
        register_q_layer(3, QAnyDimBN)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), AnyDimBN(8))
    x = torch.randn(4, 3, 12, 12)
    ref = model(x)
    assert "1" not in actcore.convert(copy.deepcopy(model), "L2").act_report.converted
    try:
        register_q_layer(AnyDimBN, QAnyDimBN)
        actcore.convert(model, "L2")
        assert type(model[1]) is QAnyDimBN and model.act_report.converted["1"] == "QAnyDimBN"
        assert torch.equal(model(x), ref)
        with pytest.raises(ValueError, match="AnyDimBN already converts to QAnyDimBN"):
            register_q_layer(AnyDimBN, type("QOther", (QBatchNormBase, AnyDimBN), {}))
    finally:
        Q_LAYERS.pop(AnyDimBN, None)
