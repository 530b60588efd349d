"""set_scope_exact: per module, the model scope keeps what is saved as it is or compresses
it, the innermost module's choice holding; with the scope exact everywhere and every Q-layer
at L0 the step is plain PyTorch's, bitwise."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from gated_net import Gated
from torch import nn

import actcore
from actcore.layers.base import QLayer
from actcore.layers.scope import scope_exact, set_scope_exact
from actcore.memory import track


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Sequential(*(Gated(64) for _ in range(3))))


_X = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(1))


def _by_module(model: nn.Module) -> dict[str, int]:
    with track(model) as report:
        out = model(_X)
    del out
    return dict(report.by_module)


def _others(by_module: dict[str, int], model: nn.Module, prefix: str) -> int:
    q = {n for n, m in model.named_modules() if isinstance(m, QLayer)}
    return sum(v for k, v in by_module.items() if k.startswith(prefix) and k not in q)


def test_a_block_kept_exact_keeps_its_own_saves_as_plain_does_and_only_its_own():
    plain = actcore.convert(_net(), level="L0")
    model = actcore.convert(_net(), level="L2")
    exact, packed = _by_module(plain), _by_module(model)
    assert _others(packed, model, "1.1") < _others(exact, plain, "1.1")  # the scope packs
    set_scope_exact(model.get_submodule("1.1"), True)
    assert scope_exact(model.get_submodule("1.1")) is True
    now = _by_module(model)
    assert _others(now, model, "1.1") == _others(exact, plain, "1.1")
    for other in ("1.0", "1.2"):
        assert _others(now, model, other) == _others(packed, model, other)
    set_scope_exact(model.get_submodule("1.1"), None)
    assert scope_exact(model.get_submodule("1.1")) is None
    assert not model.get_submodule("1.1")._forward_pre_hooks
    assert _by_module(model) == packed


def test_the_innermost_choice_holds():
    plain = actcore.convert(_net(), level="L0")
    model = actcore.convert(_net(), level="L2")
    exact, packed = _by_module(plain), _by_module(model)
    set_scope_exact(model, True)
    set_scope_exact(model.get_submodule("1.2"), False)
    now = _by_module(model)
    assert _others(now, model, "1.2") == _others(packed, model, "1.2")
    for other in ("1.0", "1.1"):
        assert _others(now, model, other) == _others(exact, plain, other)


def test_exact_everywhere_with_q_layers_at_l0_is_plain_pytorch_bitwise():
    plain = _net()
    model = actcore.convert(copy.deepcopy(plain), level="L2")
    set_scope_exact(model, True)
    for m in model.modules():
        if isinstance(m, QLayer):
            m.act_level = "L0"
    grads = []
    for net in (plain, model):
        net.zero_grad()
        F.mse_loss(net(_X), torch.ones(8, 16, 64)).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_converting_again_drops_the_choices_of_a_plan():
    model = actcore.convert(_net(), level="L2")
    top = actcore.fit_budget(
        actcore.convert(_net(), level="L0"), _X, 2**62, recompute=False, order="bytes"
    )
    assert top.kept_bytes == top.exact_bytes
    set_scope_exact(model.get_submodule("1.0"), True)
    model.__dict__["act_memory_plan"] = top  # as a plan leaves it
    actcore.convert(model, level="L2")
    assert scope_exact(model.get_submodule("1.0")) is None
