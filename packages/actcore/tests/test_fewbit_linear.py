"""Tests of actcore.fewbit's RandomizedLinear (exact forward, unbiased weight gradient,
bytes kept) and of its model surgery: map_module and convert_linear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import grad_of
from torch import Tensor, nn

import actcore.fewbit as fb
from actcore import memory
from actcore.fewbit.randomized import projection

# --------------------------------------------------------------------------------------------
# RandomizedLinear
# --------------------------------------------------------------------------------------------


def test_randomized_linear_forward_and_exact_gradients() -> None:
    torch.manual_seed(0)
    lin = fb.RandomizedLinear(24, 10)
    ref = nn.Linear(24, 10)
    ref.load_state_dict(lin.state_dict())
    assert isinstance(lin, nn.Linear) and list(lin.state_dict()) == ["weight", "bias"]
    assert "proj_ratio=0.2" in repr(lin) and "gaussian" in repr(lin)
    x = torch.randn(6, 20, 24)
    g = torch.randn(6, 20, 10)
    y, gx = grad_of(lin, x, g)
    y_ref, gx_ref = grad_of(ref, x, g)
    assert torch.equal(y, y_ref)
    assert torch.allclose(gx, gx_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    assert lin.weight.grad.shape == ref.weight.grad.shape
    assert not torch.allclose(lin.weight.grad, ref.weight.grad)  # it is an estimate


def test_randomized_linear_full_ratio_is_exact() -> None:
    torch.manual_seed(1)
    lin = fb.RandomizedLinear(8, 5, proj_ratio=1.0, distribution="rademacher")
    ref = nn.Linear(8, 5)
    ref.load_state_dict(lin.state_dict())
    x, g = torch.randn(30, 8), torch.randn(30, 5)
    grad_of(lin, x, g)
    grad_of(ref, x, g)
    assert torch.allclose(lin.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_randomized_linear_weight_gradient_is_unbiased(distribution: str) -> None:
    gen = torch.Generator().manual_seed(2)
    n, d_in, d_out, seeds = 40, 6, 5, 2000
    x = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64).requires_grad_()
    g = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    exact = g.t() @ x
    draws = []
    for seed in range(seeds):
        y = fb.randomized_linear(x, w, None, 0.2, distribution, seed=seed)
        (gw,) = torch.autograd.grad(y, w, g)
        draws.append(gw)
    draws = torch.stack(draws)
    mean, var = draws.mean(0), draws.var(0)
    z = (mean - exact) / (var / seeds).sqrt()
    assert (z.abs() <= 5).all(), z
    dof = z.numel()
    assert (z**2).sum() <= dof + 6 * math.sqrt(2 * dof)  # chi-square aggregate
    assert (var > 0).all()
    # same seed, same S: deterministic
    y = fb.randomized_linear(x, w, None, 0.2, distribution, seed=7)
    assert torch.equal(torch.autograd.grad(y, w, g)[0], draws[7])


def test_projection_has_identity_second_moment() -> None:
    n, k = 30, 12
    eye = torch.eye(n, dtype=torch.float64)
    for dist in ("gaussian", "rademacher"):
        acc = sum(projection(eye, k, s, dist).t() @ projection(eye, k, s, dist) for s in range(400))
        assert torch.allclose(acc / 400, eye, atol=0.25)
        if dist == "rademacher":
            assert torch.allclose(projection(eye, k, 0, dist).abs(), torch.tensor(k**-0.5).double())


def test_randomized_linear_keeps_a_fifth_of_the_input() -> None:
    lin = fb.RandomizedLinear(64, 32, proj_ratio=0.2)
    x = torch.randn(10, 100, 64, requires_grad=True)
    with memory.track(lin) as rep:
        y = lin(x)
    k = math.ceil(0.2 * 1000)
    assert rep.retained_bytes == k * 64 * 4
    assert rep.retained_bytes <= 0.25 * x.numel() * 4
    y.sum().backward()
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    with memory.track(lin) as rep:
        lin(x)
    assert rep.retained_bytes == 0  # frozen weight: nothing of the input is kept


def test_randomized_linear_autocast_and_bad_arguments() -> None:
    lin = fb.RandomizedLinear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"proj_ratio must be in \(0, 1\], got {bad}"):
            fb.RandomizedLinear(4, 4, proj_ratio=bad)
    with pytest.raises(ValueError, match="'uniform'"):
        fb.RandomizedLinear(4, 4, distribution="uniform")


# --------------------------------------------------------------------------------------------
# map_module, convert_linear
# --------------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), self.shared)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Tanh()})
        self.attn = nn.MultiheadAttention(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(self.body(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.heads["a"](self.heads["b"](h))


def test_map_module_paths_order_sharing_and_root() -> None:
    net = _Net()
    seen: list[str] = []

    def fn(m: nn.Module, path: str) -> nn.Module:
        seen.append(path)
        if isinstance(m, nn.GELU):
            return fb.GELU(bits=2)
        if isinstance(m, nn.Tanh):
            return fb.Tanh()
        return m

    assert fb.map_module(net, fn) is net
    assert set(seen) == {name for name, _ in net.named_modules()}
    assert seen[-1] == "" and seen.index("body.1") < seen.index("body")  # post-order
    assert isinstance(net.body[1], fb.GELU) and net.body[1].bits == 2
    assert isinstance(net.heads["b"], fb.Tanh)
    new_root = fb.map_module(net, lambda m, p: nn.Sequential(m) if p == "" else m)
    assert isinstance(new_root, nn.Sequential) and new_root[0] is net
    with pytest.raises(TypeError, match=r"must return an nn\.Module, got NoneType for 'shared'"):
        fb.map_module(_Net(), lambda m, p: None if p == "shared" else m)


def test_map_module_replaces_a_shared_module_once() -> None:
    net = _Net()
    calls = []

    def fn(m: nn.Module, path: str) -> nn.Module:
        if m is net.shared:
            calls.append(path)
            return nn.Identity()
        return m

    fb.map_module(net, fn)
    assert calls == ["shared"]
    assert isinstance(net.shared, nn.Identity) and net.body[3] is net.shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_convert_linear_preserves_state(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    net = _Net().to(dtype)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = {k: id(p) for k, p in net.named_parameters()}
    x = torch.randn(5, 4, dtype=dtype)
    y_before = net(x)
    assert fb.convert_linear(net, fb.RandomizedLinear, proj_ratio=0.5) is net
    assert type(net.body[0]) is fb.RandomizedLinear and net.body[0].proj_ratio == 0.5
    assert type(net.heads["a"]) is fb.RandomizedLinear and net.body[3] is net.shared
    assert type(net.attn.out_proj) is not fb.RandomizedLinear  # a Linear subclass: kept
    after = net.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value) and after[key].dtype == dtype
    assert {k: id(p) for k, p in net.named_parameters()} == params  # same Parameters
    assert torch.equal(net(x), y_before)
    again = fb.convert_linear(net, fb.RandomizedLinear, proj_ratio=0.1)
    assert again.body[0].proj_ratio == 0.5  # already converted layers stay as they are
    single = fb.convert_linear(nn.Linear(3, 2, bias=False), fb.RandomizedLinear)
    assert type(single) is fb.RandomizedLinear and single.bias is None
