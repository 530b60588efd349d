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
    runs = 0
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
