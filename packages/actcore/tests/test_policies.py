"""Policies: bit allocation, sensitivity estimation, AC-GC's error bound, estimation cost."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from conftest import cross_entropy_backprop, flat_grad, train_iterations
from torch import nn

from actcore.controller import Controller
from actcore.policies import ACGC, HOOK_LEVELS, AutoPrecision, FixedBits, as_policy
from actcore.saved_tensors.hooks import compress_saved_tensors


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)


def _flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return flat_grad(model, x, y).double()


def _rms_relative_error(c: Controller, x: torch.Tensor, y: torch.Tensor, draws: int) -> float:
    exact = _flat_grad(c.model, x, y)
    errs = []
    with c:
        for _ in range(draws):
            errs.append(float((_flat_grad(c.model, x, y) - exact).square().sum()))
    return math.sqrt(sum(errs) / draws / float(exact.square().sum()))


def test_level_table_and_conversions() -> None:
    assert {k: (v.bits, v.auto, v.swap) for k, v in HOOK_LEVELS.items()} == {
        "G0": (None, False, False),
        "G1": (4, False, False),
        "G1.1": (8, False, False),
        "G1.2": (2, False, False),
        "G2": (4, True, False),
        "G2.1": (3, True, False),
        "G2.2": (2, True, False),
        "G3": (4, True, True),
    }
    assert all(v.summary for v in HOOK_LEVELS.values())
    assert isinstance(as_policy(3), FixedBits) and as_policy(3).bits == 3
    assert isinstance(as_policy("acgc"), ACGC)
    with pytest.raises(ValueError, match="avg_bits must be a number in"):
        AutoPrecision(avg_bits=9)
    with pytest.raises(ValueError, match="error_bound must be a finite positive number, got -1"):
        ACGC(error_bound=-1)
    with pytest.raises(ValueError, match="adapt_interval must be >= 1, got 0"):
        AutoPrecision(adapt_interval=0)


def test_greedy_allocation_is_optimal_and_within_budget() -> None:
    """Against brute force over all bit vectors for three tensors."""
    p = AutoPrecision(avg_bits=3, min_bits=1, max_bits=6)
    keys = ["a", "b", "c"]
    p.numel = {"a": 100, "b": 300, "c": 200}
    p.spread = {"a": 1.0, "b": 1.0, "c": 1.0}
    p.sensitivity = {"a": 50.0, "b": 1.0, "c": 5.0}
    p.grad_sq = 1.0
    p._allocate(keys)
    w = {k: p.sensitivity[k] * p.spread[k] for k in keys}
    budget = 3 * sum(p.numel.values())

    def cost(bits: dict[str, int]) -> float:
        return sum(w[k] / (2 ** bits[k] - 1) ** 2 for k in keys)

    assert sum(p.plan[k] * p.numel[k] for k in keys) <= budget
    best = min(
        cost(dict(zip(keys, b, strict=True)))
        for b in itertools.product(range(1, 7), repeat=3)
        if sum(bi * p.numel[k] for bi, k in zip(b, keys, strict=True)) <= budget
    )
    assert cost(p.plan) <= 1.05 * best
    assert p.plan["a"] > p.plan["c"] > p.plan["b"]  # more sensitive: more bits


def test_auto_precision_predicts_measured_error_and_keeps_budget() -> None:
    model = _mlp()
    x, y = _data()
    c = Controller(model, "G2.1", min_numel=1, max_passes=16)
    train_iterations(c, cross_entropy_backprop(model, x, y))
    policy = c.policy
    assert isinstance(policy, AutoPrecision) and policy.estimates == 1
    assert policy.average_bits() <= 3.0 + 1e-9
    assert len(set(policy.plan.values())) > 1  # not uniform: sensitivities differ
    measured = _rms_relative_error(c, x, y, draws=12)
    # the linearised variance model predicts the real gradient error within a factor 2
    assert 0.5 <= measured / policy.predicted_error <= 2.0, (measured, policy.predicted_error)


@pytest.mark.parametrize("bound", [0.05, 0.01])
def test_acgc_measured_gradient_error_below_bound(bound: float) -> None:
    model = _mlp()
    x, y = _data()
    c = Controller(model, policy="acgc", error_bound=bound, min_numel=1)
    train_iterations(c, cross_entropy_backprop(model, x, y))
    policy = c.policy
    assert isinstance(policy, ACGC)
    assert policy.predicted_error <= bound
    compressed = [b for b in policy.plan.values() if b is not None]
    assert compressed and policy.average_bits() < 32  # it does compress
    measured = _rms_relative_error(c, x, y, draws=12)
    assert measured <= bound, (measured, bound, policy.plan)


def test_acgc_tighter_bound_needs_more_bits() -> None:
    x, y = _data()
    avg = []
    for bound in (0.2, 0.02):
        model = _mlp()
        c = Controller(model, policy="acgc", error_bound=bound, min_numel=1)
        train_iterations(c, cross_entropy_backprop(model, x, y))
        avg.append(c.policy.average_bits())
    assert avg[0] < avg[1]


def test_estimation_overhead_amortised_below_ten_percent() -> None:
    """Cost of one adapt step, amortised over the default interval, vs a normal iteration.

    A deep narrow network saves more tensors than ``max_passes``, so the adapt step runs the
    full 1 + max_passes estimation passes (the cost ratio does not depend on width).
    """
    torch.manual_seed(0)
    blocks = [m for _ in range(6) for m in (nn.Linear(64, 64), nn.Dropout(0.1), nn.GELU())]
    model = nn.Sequential(*blocks, nn.Linear(64, 8))
    x = torch.randn(32, 64)

    def backprop() -> None:
        model.zero_grad()
        model(x).square().mean().backward()

    c = Controller(model, "G2", min_numel=1)
    interval = c.policy.adapt_interval
    with c:
        backprop()
        c.iterate(backprop)  # warm-up adapt at iteration 0
        assert len(c.bit_plan) > c.policy.max_passes
        steps = []
        for _ in range(3):
            t0 = time.perf_counter()
            backprop()
            c.iterate(backprop)  # no adapt
            steps.append(time.perf_counter() - t0)
        c.iteration = interval  # the next call adapts
        t0 = time.perf_counter()
        c.iterate(backprop)
        adapt = time.perf_counter() - t0
    overhead = adapt / (sorted(steps)[1] * interval)
    print(f"adapt {adapt:.3f}s, iteration {sorted(steps)[1]:.4f}s, amortised {overhead:.1%}")
    assert overhead <= 0.10


def test_bare_context_uses_current_plan() -> None:
    p = AutoPrecision(avg_bits=2)
    assert p.bits_for("anything") == 2  # before any estimate: the average
    p.plan = {"k": 5}
    assert p.bits_for("k") == 5 and p.bits_for("new") == 2
    with compress_saved_tensors(p):
        pass
    assert ACGC(0.1).bits_for("unseen") == 8  # unmeasured tensors: the safe side


def test_probe_distances_are_those_of_the_flattened_gradients() -> None:
    """The probes' squared gradient distances, taken one parameter at a time, are those of
    the flattened gradients (which each pass used to copy whole); mismatched passes raise."""
    from actcore.policies.sensitivity import _squared_distance

    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(s, generator=gen) for s in ((64, 32), (32,), (8, 3, 3, 3))]
    b = [t + 0.01 * torch.randn(t.shape, generator=gen) for t in a]
    flat_a, flat_b = (torch.cat([t.reshape(-1) for t in g]) for g in (a, b))
    torch.testing.assert_close(_squared_distance(a, b), (flat_a - flat_b).square().sum())
    torch.testing.assert_close(_squared_distance(a, None), flat_a.square().sum())
    assert torch.equal(torch.cat([t.reshape(-1) for t in a]), flat_a)  # (left as they were)
    with pytest.raises(RuntimeError, match="same parameters"):
        _squared_distance(a[:2], [*b[:2], a[0]])
