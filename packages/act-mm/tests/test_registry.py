"""act_mm's registry entries: every name builds a Q-layer equal in forward to the stock layer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from mmengine.registry import MODELS, Registry
from mmengine.utils import import_modules_from_strings
from mmengine.utils.dl_utils.parrots_wrapper import _BatchNorm
from torch import nn

import act_mm
import actcore
from act_mm.registry import REGISTERED, register_layers

# name -> (stock layer, registry config without 'type', input shape)
C1, C2, C3 = (2, 3, 16), (2, 3, 12, 12), (2, 3, 6, 6, 6)
CASES: dict[str, tuple[nn.Module, dict, tuple[int, ...]]] = {
    "QConv1d": (nn.Conv1d(3, 4, 3), dict(in_channels=3, out_channels=4, kernel_size=3), C1),
    "QConv2d": (nn.Conv2d(3, 4, 3), dict(in_channels=3, out_channels=4, kernel_size=3), C2),
    "QConv": (nn.Conv2d(3, 4, 3), dict(in_channels=3, out_channels=4, kernel_size=3), C2),
    "QConv3d": (nn.Conv3d(3, 4, 3), dict(in_channels=3, out_channels=4, kernel_size=3), C3),
    "QConvTranspose1d": (
        nn.ConvTranspose1d(3, 4, 3, stride=2),
        dict(in_channels=3, out_channels=4, kernel_size=3, stride=2),
        C1,
    ),
    "QConvTranspose2d": (
        nn.ConvTranspose2d(3, 4, 3, stride=2),
        dict(in_channels=3, out_channels=4, kernel_size=3, stride=2),
        C2,
    ),
    "QConvTranspose3d": (
        nn.ConvTranspose3d(3, 4, 3),
        dict(in_channels=3, out_channels=4, kernel_size=3),
        C3,
    ),
    "QLinear": (nn.Linear(16, 8), dict(in_features=16, out_features=8), C1),
    "QBN": (nn.BatchNorm2d(3), dict(num_features=3), C2),
    "QBN1d": (nn.BatchNorm1d(3), dict(num_features=3), C1),
    "QBN2d": (nn.BatchNorm2d(3), dict(num_features=3), C2),
    "QBN3d": (nn.BatchNorm3d(3), dict(num_features=3), C3),
    "QSyncBN": (nn.SyncBatchNorm(3), dict(num_features=3), C2),
    "QGN": (nn.GroupNorm(2, 4), dict(num_channels=4, num_groups=2), (2, 4, 12, 12)),
    "QLN": (nn.LayerNorm(16), dict(normalized_shape=16), C1),
    "QBatchNorm1d": (nn.BatchNorm1d(3), dict(num_features=3), C1),
    "QBatchNorm2d": (nn.BatchNorm2d(3), dict(num_features=3), C2),
    "QBatchNorm3d": (nn.BatchNorm3d(3), dict(num_features=3), C3),
    "QSyncBatchNorm": (nn.SyncBatchNorm(3), dict(num_features=3), C2),
    "QGroupNorm": (nn.GroupNorm(2, 4), dict(num_groups=2, num_channels=4), (2, 4, 12, 12)),
    "QLayerNorm": (nn.LayerNorm(16), dict(normalized_shape=16), C1),
    "QReLU": (nn.ReLU(), {}, C2),
    "QLeakyReLU": (nn.LeakyReLU(0.1), dict(negative_slope=0.1), C2),
    "QReLU6": (nn.ReLU6(), {}, C2),
    "QHardtanh": (nn.Hardtanh(-0.5, 0.5), dict(min_val=-0.5, max_val=0.5), C2),
    "QGELU": (nn.GELU(), {}, C2),
    "QSiLU": (nn.SiLU(), {}, C2),
    "QSwish": (nn.SiLU(), {}, C2),
    "QSigmoid": (nn.Sigmoid(), {}, C2),
    "QTanh": (nn.Tanh(), {}, C2),
    "QHSwish": (nn.Hardswish(), {}, C2),
    "QHardswish": (nn.Hardswish(), {}, C2),
    "QELU": (nn.ELU(), {}, C2),
    "QMish": (nn.Mish(), {}, C2),
    "QDropout": (nn.Dropout(0.5), dict(p=0.5), C2),
    "QMaxPool1d": (nn.MaxPool1d(2), dict(kernel_size=2), C1),
    "QMaxPool2d": (nn.MaxPool2d(3, 2, 1), dict(kernel_size=3, stride=2, padding=1), C2),
    "QMaxPool3d": (nn.MaxPool3d(2), dict(kernel_size=2), C3),
    "QAvgPool1d": (nn.AvgPool1d(2), dict(kernel_size=2), C1),
    "QAvgPool2d": (nn.AvgPool2d(2), dict(kernel_size=2), C2),
    "QAvgPool3d": (nn.AvgPool3d(2), dict(kernel_size=2), C3),
}
ABBR = {"bn": ("QBN", "QBN1d", "QBN2d", "QBN3d", "QSyncBN"), "gn": ("QGN",), "ln": ("QLN",)}


def test_every_registered_name_is_tested_and_in_the_root_registry():
    assert set(CASES) == set(REGISTERED)
    assert {"QConv2d", "QBN", "QSyncBN", "QGN", "QLN", "QReLU", "QGELU", "QSiLU"} <= set(CASES)
    for name, cls in REGISTERED.items():
        assert MODELS.get(name) is cls
        assert MODELS.scope == "mmengine"  # the root: every OpenMMLab scope's parent


@pytest.mark.parametrize("name", sorted(CASES))
def test_built_layer_is_stock_layer_with_same_state_and_forward(name):
    stock, cfg, shape = CASES[name]
    torch.manual_seed(0)
    for p in stock.parameters():  # non-trivial affine parameters
        nn.init.normal_(p)
    layer = MODELS.build(dict(type=name, **cfg))
    assert isinstance(layer, type(stock))
    assert type(layer).__module__.split(".")[0] in ("actcore", "act_mm")
    if not name.startswith(
        ("QGELU", "QSiLU", "QSwish", "QSigmoid", "QTanh", "QH", "QELU", "QMish")
    ):
        assert isinstance(layer, actcore.layers.QLayer)
    assert list(layer.state_dict()) == list(stock.state_dict())
    layer.load_state_dict(stock.state_dict())
    layer.train()
    stock.train()
    x = torch.randn(shape)
    xq = x.clone().requires_grad_()  # so the Q-layer takes its compressing path
    xs = x.clone().requires_grad_()
    torch.manual_seed(1)
    yq = layer(xq)
    torch.manual_seed(1)
    ys = stock(xs)
    assert torch.equal(yq, ys), f"{name}: forward differs from {type(stock).__name__}"
    for (k, a), b in zip(layer.state_dict().items(), stock.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: buffer {k} updated differently"
    w = torch.randn(ys.shape)  # a loss whose gradient does not vanish through normalization
    (yq * w).sum().backward()
    (ys * w).sum().backward()
    assert xq.grad is not None and torch.isfinite(xq.grad).all()
    # compressed activations give an approximate (unbiased) gradient, not a different one
    rel = (xq.grad - xs.grad).norm() / xs.grad.norm().clamp_min(1e-12)
    assert rel < 0.5, f"{name}: relative gradient error {rel:.3f}"


@pytest.mark.parametrize("abbr", sorted(ABBR))
def test_norm_layers_carry_mmcv_abbreviations(abbr):
    # mmcv's build_norm_layer names a layer after its class's `_abbr_` (its rule 1), then
    # after its torch base class (rule 2): both must give the stock name (bn1, gn, ln, ...)
    bases = {"bn": _BatchNorm, "gn": nn.GroupNorm, "ln": nn.LayerNorm}
    for name in ABBR[abbr]:
        cls = MODELS.get(name)
        assert cls._abbr_ == abbr
        assert issubclass(cls, bases[abbr])


def test_qgn_takes_build_norm_layer_positional_convention():
    # build_norm_layer(cfg, num_features) calls norm_layer(num_features, **cfg)
    layer = MODELS.get("QGN")(8, num_groups=4)
    assert (layer.num_channels, layer.num_groups) == (8, 4)
    assert list(layer.state_dict()) == list(nn.GroupNorm(4, 8).state_dict())


@pytest.mark.parametrize("name", ["QGELU", "QSigmoid", "QTanh", "QSiLU", "QReLU"])
def test_activations_accept_convmodule_inplace_argument(name):
    # mmcv's ConvModule passes inplace= to activations whose name it does not know
    layer = MODELS.build(dict(type=name, inplace=True))
    assert isinstance(layer, nn.Module)


def test_unknown_type_fails_with_mmengine_key_error():
    with pytest.raises(KeyError, match="QConv4d is not in the"):
        MODELS.build(dict(type="QConv4d", in_channels=1, out_channels=1, kernel_size=1))


def test_registering_again_is_a_no_op():
    before = dict(MODELS.module_dict)
    assert register_layers() == []
    import_modules_from_strings(["act_mm"])  # what a config's custom_imports does
    import_modules_from_strings(["act_mm"])
    assert MODELS.module_dict == before


def test_a_foreign_entry_under_our_name_is_an_error_not_overwritten():
    registry = Registry("test_models")
    registry.register_module(name="QReLU", module=nn.ReLU)
    with pytest.raises(KeyError, match=r"QReLU is already registered in test_models.*ReLU"):
        register_layers(registry)
    assert registry.get("QReLU") is nn.ReLU


def test_reloading_act_mm_replaces_its_own_entries_without_error():
    # in a subprocess: reloading redefines act_mm's classes for the rest of the process
    code = textwrap.dedent(
        """
        import importlib
        import act_mm, act_mm.hooks, act_mm.layers, act_mm.registry
        from mmengine.registry import HOOKS, MODELS
        old = MODELS.get("QGN")
        for mod in (act_mm.layers, act_mm.registry, act_mm.hooks, act_mm):
            importlib.reload(mod)
        assert MODELS.get("QGN") is act_mm.QGN is not old
        assert HOOKS.get("ACTConvertHook") is act_mm.ACTConvertHook
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_package_exports():
    assert act_mm.ACTConvertHook.__name__ == "ACTConvertHook"
    assert set(act_mm.__all__) >= {"ACTConvertHook", "REGISTERED", "register_layers", "QGN"}
