"""A recomputed activation whose backward op reads only its input (gelu, silu, mish,
hardswish, softplus) calls that op in backward instead of rerunning its forward: the same
gradient bit for bit, one forward op less."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.layers import routing

ACTIVATIONS = {
    "gelu": (lambda t: F.gelu(t), "gelu"),
    "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), "gelu"),
    "silu": (F.silu, "silu"),
    "mish": (F.mish, "mish"),
    "hardswish": (F.hardswish, "hardswish"),
    "softplus": (lambda t: F.softplus(t, beta=2.0, threshold=5.0), "softplus"),
}


class Block(nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(32, 64), nn.Linear(64, 8), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Gradients of one step, and how often the activation's forward op ran in it."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.profiler.profile() as prof:
        model(x).square().sum().backward()
    name = model.act_op
    runs = sum(e.count for e in prof.key_averages() if e.key == f"aten::{name}")
    return [p.grad.clone() for p in model.parameters()], runs


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_recomputed_activation_backward_skips_the_rerun(
    name: str, monkeypatch: pytest.MonkeyPatch, small_tensors: None
) -> None:
    act, op = ACTIVATIONS[name]
    x = torch.randn(16, 32) * 3
    torch.manual_seed(0)
    model = Block(act)
    actcore.convert(model, level="L2")
    model.act_op = op
    twin = copy.deepcopy(model)  # (the same rounding seeds to come)
    direct, runs_direct = _grads(model, x)
    monkeypatch.setattr(routing, "_INPUT_DERIVATIVES", {})  # rerun and differentiate
    rerun, runs_rerun = _grads(twin, x)
    assert all(torch.equal(a, b) for a, b in zip(direct, rerun, strict=True))
    assert runs_direct == runs_rerun - 1  # forward, plus the rerun only without the op


def test_under_autocast_the_forward_is_rerun(small_tensors: None) -> None:
    """Autocast may run the op in another dtype than its input's: rerun it as it ran."""
    torch.manual_seed(0)
    model = Block(F.silu)
    actcore.convert(model, level="L2")
    model.act_op = "silu"
    x = torch.randn(16, 32)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile() as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
    runs = sum(e.count for e in prof.key_averages() if e.key == "aten::silu")
    assert runs >= 2 and all(p.grad is not None for p in model.parameters())


class InPlaceBlock(nn.Module):
    """fc1, an activation written into fc1's output (``inplace=True``), fc2."""

    def __init__(self, act, inplace: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act, self.inplace = (
            nn.Linear(32, 64),
            nn.Linear(64, 8),
            act,
            inplace,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x), inplace=self.inplace))


IN_PLACE = {"hardswish": F.hardswish, "silu": F.silu, "mish": F.mish, "elu": F.elu}


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_activations_are_recomputed_like_out_of_place_ones(
    name: str, small_tensors: None
) -> None:
    """``F.hardswish(h, inplace=True)`` (MobileNetV3's blocks) goes the recomputed route, not
    the saved-tensor hooks: the input is packed before it is overwritten. The forward is the
    plain model's bit for bit and the gradients are the out-of-place twin's bit for bit (the
    same packings, the same rounding seeds); elu has no input-only backward op, so its
    backward reruns the out-of-place forward."""
    from actcore.layers.recompute import RecomputeFunction

    act = IN_PLACE[name]
    torch.manual_seed(0)
    plain = InPlaceBlock(act, inplace=True)
    model, twin = copy.deepcopy(plain), copy.deepcopy(plain)
    twin.inplace = False
    actcore.convert(model, level="L2")
    actcore.convert(twin, level="L2")
    x = torch.randn(16, 32) * 3
    outs, grads = [], []
    for m in (model, twin, plain):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = m(x)
        out.square().sum().backward()
        outs.append(out)
        grads.append([p.grad for p in m.parameters()])
    assert torch.equal(outs[0], outs[2])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    seen = []
    hook = model.fc2.register_forward_pre_hook(lambda _, args: seen.append(args[0].grad_fn))
    model(x)
    hook.remove()
    assert type(seen[0]).__name__ == f"{RecomputeFunction.__name__}Backward"


class LeafSilu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.silu(x, inplace=True))


def test_an_in_place_activation_on_a_leaf_raises_as_the_plain_op(small_tensors: None) -> None:
    """A leaf that requires grad cannot be overwritten: autograd's own error, as plain."""
    model = LeafSilu()
    leaf = "a leaf Variable that requires grad (is being|has been) used in an in-place"
    with pytest.raises(RuntimeError, match=leaf):
        model(torch.randn(4, 64, requires_grad=True))
    actcore.convert(model, level="L2")
    with pytest.raises(RuntimeError, match=leaf):
        model(torch.randn(4, 64, requires_grad=True))
