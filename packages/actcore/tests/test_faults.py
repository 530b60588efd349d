"""Faults never corrupt state silently: non-finite steps, bad states, repeated module calls."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import bn_mlp
from torch import nn

import actcore
from actcore.adaptive import AdaptiveBits
from actcore.controller import Controller

pytestmark = pytest.mark.usefixtures("small_tensors")


def _batch(step: int, n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 64, generator=g) * torch.logspace(-2, 1, n)[:, None]


def _tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def _all_finite(scheme: AdaptiveBits) -> bool:
    state = scheme.state_dict()
    floats = [t for t in _tensors(state) if t.is_floating_point()]
    return bool(floats) and all(bool(t.isfinite().all()) for t in floats)


# --- 1. non-finite steps ------------------------------------------------------------------


def test_adaptive_bits_skips_non_finite_steps(caplog: pytest.LogCaptureFixture) -> None:
    """A NaN loss and an inf input leave the statistics finite; counted and logged once."""
    model = actcore.convert(bn_mlp(), level="L3")
    scheme = model.act_adaptive
    scheme.interval = 4
    with caplog.at_level(logging.WARNING, logger="actcore"):
        for step in range(12):
            x = _batch(step)
            if step == 5:
                x[3, 7] = math.inf  # a bad batch: the forward statistics are not finite
            model.zero_grad()
            loss = model(x).square().mean()
            if step in (2, 9):
                loss = loss * math.nan  # an overflowing step: every gradient is NaN
            loss.backward()
    assert scheme.steps == 12
    assert _all_finite(scheme)
    assert scheme.skipped >= 2 * 4  # two NaN backward passes through 4 layers, and more
    assert all(st.plan for st in scheme.layers.values())
    assert scheme.average_bits() <= scheme.budget + 1e-9
    warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1


def _clean_or_nan(model: nn.Module, step: int, poison: bool):
    x, y = _batch(step, 32)[:, :32], torch.arange(32) % 4

    def backprop() -> torch.Tensor:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if poison:
            loss = loss * math.nan
        loss.backward()
        return loss

    return backprop


@pytest.mark.parametrize("policy", ["auto", "acgc"])
def test_policy_estimate_with_nan_gradients_is_dropped(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan and sensitivities stay finite and as they were; AC-GC keeps its bound."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.Linear(128, 4))
    c = Controller(model, "G2", policy=policy, adapt_interval=2, min_numel=1)
    with c, caplog.at_level(logging.WARNING, logger="actcore"):
        for it in range(6):
            backprop = _clean_or_nan(model, it, poison=it in (2, 4))
            backprop()
            before = copy.deepcopy(c.policy.state_dict())
            c.iterate(backprop)
            if it in (2, 4):
                after = c.policy.state_dict()
                assert after["plan"] == before["plan"]
                assert after["sensitivity"] == before["sensitivity"]
    state = c.policy.state_dict()
    assert state["skipped"] == 2 and state["estimates"] == 1
    assert all(math.isfinite(v) for v in state["sensitivity"].values())
    assert math.isfinite(state["grad_sq"]) and state["grad_sq"] > 0
    if policy == "acgc":
        assert state["predicted_error"] <= c.policy.error_bound
    assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 1


def _amp_run(overflow: bool, steps: int = 40) -> AdaptiveBits:
    """fp16 autocast + GradScaler on CPU; with ``overflow`` every 10th step overflows."""
    model = actcore.convert(bn_mlp(), level="L3")
    scheme = model.act_adaptive
    scheme.interval = 10
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    for step in range(steps):
        x = _batch(step)
        if overflow and step % 10 == 7:
            x = x * 1e5  # fp16 activations overflow: inf forward, NaN/inf gradients
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return scheme


def test_amp_fp16_overflow_every_tenth_step_keeps_statistics_and_plan_quality() -> None:
    clean, faulty = _amp_run(False), _amp_run(True)
    assert clean.skipped == 0 and faulty.skipped > 0
    assert _all_finite(faulty)
    assert faulty.average_bits() <= faulty.budget + 1e-9
    # judged by the clean run's statistics, the faulty run's plan is as good as its own
    plan = {name: st.plan for name, st in faulty.layers.items()}
    ratio = clean.predicted_variance(plan) / clean.predicted_variance()
    assert ratio <= 1.10, ratio
    norms = [st for st in faulty.layers.values() if st.norm]
    assert norms and all(min(st.plan) >= 2 for st in norms)


# --- 3. the state holds everything a replan needs ---------------------------------------------


def test_resumed_state_replans_identically_norms_included() -> None:
    model = actcore.convert(bn_mlp(), level="L3")
    scheme = model.act_adaptive
    scheme.interval = 100
    for step in range(7):
        model.zero_grad()
        model(_batch(step)).square().mean().backward()
    state = copy.deepcopy(scheme.state_dict())
    fresh = AdaptiveBits()  # a new process: nothing attached, nothing observed
    fresh.load_state_dict(state)
    scheme.replan()
    fresh.replan()
    assert {n: s.plan for n, s in fresh.layers.items()} == {
        n: s.plan for n, s in scheme.layers.items()
    }
    assert fresh.layers["1"].norm and min(fresh.layers["1"].plan) >= 2


# --- 6. load_state_dict checks everything first ---------------------------------------------


def _trained_scheme() -> AdaptiveBits:
    model = actcore.convert(bn_mlp(), level="L3")
    model.act_adaptive.interval = 3
    for step in range(4):
        model.zero_grad()
        model(_batch(step)).square().mean().backward()
    return model.act_adaptive


def _same_state(a: dict, b: dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s.update(interval=0), "interval must be a positive int, got 0"),
        (lambda s: s.update(budget=9.0), "budget <= max_bits <= 8"),
        (lambda s: s["layers"]["0"].update(plan=torch.tensor([9] * 16)), r"plan bits \[9"),
        (lambda s: s["layers"]["0"].update(plan=torch.tensor([2, 2, 1])), "plan has 3 entries"),
        (lambda s: s["layers"]["3"].update(plan=torch.tensor([1, 2])), "largest first"),
        (lambda s: s["layers"]["4"].update(sens=torch.tensor(math.nan)), "non-finite"),
        (lambda s: s.update(steps=-1), "steps must be >= 0"),
        (lambda s: s["layers"]["1"].update(norm="yes"), "norm must be a bool"),
    ],
)
def test_adaptive_bits_rejects_a_bad_state_and_changes_nothing(change, error) -> None:
    scheme = _trained_scheme()
    before = copy.deepcopy(scheme.state_dict())
    bad = copy.deepcopy(before)
    bad["layers"]["0"]["plan"] = torch.tensor([3] * 8 + [1] * 8, dtype=torch.int8)  # valid
    change(bad)
    with pytest.raises((ValueError, TypeError), match=error):
        scheme.load_state_dict(bad)
    assert _same_state(scheme.state_dict(), before)


@pytest.mark.parametrize("policy", ["auto", "acgc"])
def test_policy_and_controller_reject_a_bad_state_and_change_nothing(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    c = Controller(model, "G2", policy=policy, adapt_interval=2, min_numel=1)
    with c:
        backprop = _clean_or_nan(model, 0, poison=False)
        backprop()
        c.iterate(backprop)
    before = copy.deepcopy(c.state_dict())
    key = next(iter(before["policy"]["plan"]))
    cases = [
        ({"plan": {**before["policy"]["plan"], key: 0}}, "outside min_bits..max_bits"),
        ({"plan": {**before["policy"]["plan"], "new": 4}}, "have no numel"),
        ({"sensitivity": {key: math.nan}}, "finite number"),
        ({"estimates": -1}, "estimates must be"),
    ]
    for change, error in cases:
        bad = copy.deepcopy(before)
        bad["policy"].update(change)
        bad["iteration"] = 7
        with pytest.raises((ValueError, TypeError), match=error):
            c.load_state_dict(bad)
        assert _same_state(c.state_dict(), before)
    with pytest.raises(ValueError, match="iteration must be >= 0, got -1"):
        c.load_state_dict({**before, "iteration": -1})
    assert _same_state(c.state_dict(), before)


# --- 8. a module called twice per forward is one step ---------------------------------------


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.relu(self.inp(x)))
        return self.out(self.shared(h))  # the shared layer runs twice


def test_module_called_twice_per_forward_counts_one_step(monkeypatch) -> None:
    torch.manual_seed(0)
    model = actcore.convert(_Twice(), level="L3")
    scheme = model.act_adaptive
    scheme.interval = 5
    replans: list[int] = []
    replan = scheme.replan
    monkeypatch.setattr(scheme, "replan", lambda: (replans.append(scheme.steps), replan())[1])
    for step in range(10):
        model.zero_grad()
        model(_batch(step)).square().mean().backward()
    assert scheme.steps == 10 and replans == [5, 10]
    # two forwards before one backward (e.g. two views of a batch): still one step
    model.zero_grad()
    (model(_batch(0)).square().mean() + model(_batch(1)).square().mean()).backward()
    assert scheme.steps == 11


# --- 2. double backward: exact, or a clear error naming the layer -------------------------


def _penalty_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """WGAN-GP style: the squared norm of d out / d x, backpropagated to the parameters."""
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    g.square().sum().backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.LayerNorm(32),
        lambda: nn.BatchNorm1d(32),
        lambda: nn.GroupNorm(4, 32),
        lambda: nn.RMSNorm(32),
    ],
)
def test_double_backward_through_norms_exact_or_refused(norm) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), norm(), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(64, 16)
    exact = _penalty_grads(plain, x)
    # L2 stores the norm's input at 4 bits: refused at once, naming the layer
    lossy = actcore.convert(copy.deepcopy(plain), "L2")
    with pytest.raises(RuntimeError, match=r"double backward .* '1'.*stored compressed"):
        _penalty_grads(lossy, x)
    # linear inputs only (layers_only, norms exact): the norm's second derivative is exact
    kept = actcore.convert(copy.deepcopy(plain), "L2", exclude=["0", "3"], layers_only=True)
    kept[1].act_level = "L1"  # normalization inputs at full precision
    if isinstance(plain[1], nn.GroupNorm):  # aten's group-norm backward has no derivative
        with pytest.raises(RuntimeError, match=r"double backward .*QGroupNorm '1'"):
            _penalty_grads(kept, x)
        return
    got = _penalty_grads(kept, x)
    for a, b in zip(got, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_double_backward_through_lossy_linear_exact_for_input_penalties() -> None:
    """A penalty on d out / d x needs only grad @ W: exact at 4 bits; a penalty on a weight
    gradient needs the lost input's derivative: it raises, naming the layer."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    x = torch.randn(64, 16)
    exact = _penalty_grads(plain, x)
    model = actcore.convert(copy.deepcopy(plain), "L2", layers_only=True)
    got = _penalty_grads(model, x)
    for a, b in zip(got, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    loss = model(x).square().mean()
    (gw,) = torch.autograd.grad(loss, model[2].weight, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward .*QLinear '2'"):
        gw.square().sum().backward()


def test_double_backward_through_fewbit_names_the_table() -> None:
    from actcore.fewbit import functional as fb

    x = torch.randn(64, 16, requires_grad=True)
    (g,) = torch.autograd.grad(fb.gelu(x, bits=3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="few-bit activation derivative"):
        g.square().sum().backward()
    # a mask code's derivative is piecewise constant: its second derivative (0) is exact
    (g,) = torch.autograd.grad(fb.hardsigmoid(x).sum(), x, create_graph=True)
    (g * x).sum().backward()  # d/dx (g * x) = g, as g's own derivative is 0
    assert torch.equal(x.grad, g.detach())


# --- 10. NaN in, NaN out ---------------------------------------------------------------------


def test_fewbit_table_gradient_is_nan_for_nan_input() -> None:
    from actcore.fewbit import functional as fb

    x = torch.randn(4, 256)
    x[1, 7] = math.nan
    x.requires_grad_(True)
    fb.gelu(x, bits=3).sum().backward()
    assert bool(x.grad[1, 7].isnan())
    clean = torch.randn(4, 256, requires_grad=True)
    fb.gelu(clean, bits=3).sum().backward()
    assert bool(clean.grad.isfinite().all())


def test_every_quantizing_compressor_keeps_nan() -> None:
    from actcore.compressors import PerSampleQuantize, Quantize, ZeroValue
    from actcore.ops import pack_mask

    x = torch.randn(4, 512)
    x[2, 100] = math.nan
    comps = [
        Quantize(2),
        Quantize(4, per_sample=False),
        PerSampleQuantize(((4, 2), (2, 2))),
        ZeroValue(pack_mask(x != 0), Quantize(3, per_sample=False)),
    ]
    for comp in comps:
        tensors, meta = comp.pack(x)
        y = comp.unpack(tensors, meta)
        assert bool(y[2, 100].isnan()), comp
        assert bool(y[0].isfinite().all()), comp
