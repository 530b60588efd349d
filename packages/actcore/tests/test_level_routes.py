"""Each route resolves its level names in its own table only: ``convert``'s (ActNN's, ``L0``
.. ``L5``) and ``Controller``'s (GACT's, ``G0`` .. ``G3``); no name is in both."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch import nn

import actcore
from actcore import policies
from actcore.bench.routes import check_levels, route_levels
from actcore.config import LEVELS, level_spec
from actcore.layers.stash import layer_spec
from actcore.policies import HOOK_LEVELS, hook_level
from actcore.policy_scheme import PolicyScheme


def test_each_level_name_belongs_to_one_route() -> None:
    # ActNN's L3 on the layer route: 2-bit adaptive; GACT's L3, G3 on the hooks route: 4-bit
    # auto precision with CPU swap
    assert not set(LEVELS) & set(HOOK_LEVELS)
    layers, hooks = level_spec("L3"), hook_level("G3")
    assert (layers.conv_bits, layers.adaptive, layers.swap) == (2, True, False)
    assert (hooks.bits, hooks.auto, hooks.swap) == (4, True, True)
    # the other route's name is refused, saying whose it is
    with pytest.raises(ValueError, match=re.escape("valid levels: " + ", ".join(LEVELS))):
        level_spec("L1.2")
    with pytest.raises(ValueError, match=r"'G2' is a level of the saved-tensor hooks route"):
        actcore.convert(nn.Linear(2, 2), "G2")
    with pytest.raises(ValueError, match=r"'L2' is a level of the layer-swap route"):
        actcore.Controller(nn.Linear(2, 2), "L2")
    with pytest.raises(ValueError, match=r"'L3' is a level of the layer-swap route"):
        actcore.compress_saved_tensors("L3")
    with pytest.raises(ValueError, match=re.escape("valid levels: " + ", ".join(HOOK_LEVELS))):
        hook_level("G4")
    assert route_levels("layers") == (LEVELS, level_spec)
    assert route_levels("hooks") == (HOOK_LEVELS, hook_level)
    assert check_levels(["fp", "L4"], "layers") == ["fp", "L4"]
    with pytest.raises(ValueError, match="for --route hooks"):
        check_levels(["L4"], "hooks")
    with pytest.raises(ValueError, match=re.escape("'L1.2'; valid levels: fp, L0")):
        check_levels(["L1.2"], "layers")


@pytest.mark.parametrize(("kind", "options"), [("fixed", {}), ("auto", {}), ("acgc", {})])
def test_convert_policies_resolve_no_hooks_level(monkeypatch, kind, options) -> None:
    def refuse(level):
        raise AssertionError(f"the layer route looked up hooks level {level!r}")

    monkeypatch.setattr(policies, "hook_level", refuse)
    model = actcore.convert(nn.Sequential(nn.Linear(8, 8)), "L3", policy=kind, **options)
    scheme = model.act_policy
    assert isinstance(scheme, PolicyScheme) and scheme.policy.name == kind
    assert scheme.policy.swap is False  # swapping stays the layer level's business
    if kind == "fixed":
        assert scheme.policy.bits == 2  # the level's conv/linear bits
    if kind == "auto":
        assert scheme.policy.avg_bits == 2
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_convert_policy_options_are_checked_per_kind() -> None:
    with pytest.raises(
        TypeError, match=r"unknown option\(s\) \['error_bound'\] for policy 'fixed'"
    ):
        actcore.convert(nn.Sequential(nn.Linear(8, 8)), "L2", policy="fixed", error_bound=0.1)
    with pytest.raises(ValueError, match="unknown policy 'greedy'"):
        actcore.convert(nn.Sequential(nn.Linear(8, 8)), "L2", policy="greedy")


class _Block(nn.Module):
    """Conv, batch norm, ReLU, a functional GELU, layer norm, linear: every layer kind and a
    routed functional, so each place that reads a level runs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.row_norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x))).flatten(2)
        return self.head(self.row_norm(nn.functional.gelu(h))).mean(1)


@pytest.mark.parametrize("route", ["convert", "hooks"])
def test_the_level_is_resolved_once_not_per_pack(route: str, monkeypatch) -> None:
    """A level name is looked up where it enters (convert, Controller, the config): the
    layers keep the resolved spec, so training steps never look a name up again."""
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(4, 3, 8, 8)
    if route == "convert":
        actcore.convert(model, "L3")
        assert all(m.act_spec is LEVELS["L3"] for m in model.modules() if hasattr(m, "act_spec"))
    else:
        controller = actcore.Controller(model, level="G2")
        controller.install_hook()
    monkeypatch.setattr(actcore.config, "level", actcore.config.level)  # (restored after)
    lookups: list[object] = []
    resolver = importlib.import_module("actcore.config")  # (actcore.config: the settings)
    real = resolver.lookup_level

    def counted(*args: object) -> object:
        lookups.append(args[1])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(resolver, "lookup_level", counted)
    try:
        for _ in range(3):
            model(x).sum().backward()
    finally:
        if route == "hooks":
            controller.uninstall_hook()
    assert lookups == []
    actcore.set_optimization_level("L2")  # an entry point: looks the name up, once
    assert lookups == ["L2"] and actcore.config.spec is LEVELS["L2"]


def test_layers_keep_the_spec_and_their_level_name_resolves_on_assignment() -> None:
    layer = actcore.convert(nn.Sequential(nn.Linear(4, 4)), "L2")[0]
    assert layer.act_spec is LEVELS["L2"] and layer.act_level == "L2"
    layer.act_level = "L1"
    assert layer.act_spec is LEVELS["L1"]
    with pytest.raises(ValueError, match=r"unknown optimization level 'L9'; valid levels"):
        layer.act_level = "L9"
    before = actcore.config.spec
    with pytest.raises(ValueError, match=r"unknown optimization level 'L1.2'"):
        actcore.config.level = "L1.2"  # the config resolves its name on assignment too
    assert actcore.config.spec is before and actcore.config.level == before.name


def test_a_q_layer_built_directly_has_no_name_and_the_process_wide_level() -> None:
    """``QConv2d(...)`` written in a model (as OpenMMLab configs do) is not yet converted: no
    name (adaptive bits and policies then leave it alone), the process-wide level."""
    layer = actcore.QConv2d(3, 4, 3)
    assert layer.act_name is None and layer.act_spec is None and layer.act_level is None
    assert layer_spec(layer) is actcore.config.spec
