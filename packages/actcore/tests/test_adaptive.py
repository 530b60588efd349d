"""Adaptive bits (L3): budget, optimality of the allocation, unbiasedness, state_dict."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from torch import nn

import actcore
from actcore.adaptive import AdaptiveBits, _LayerStats
from actcore.compressors import PerSampleQuantize, Quantize, sample_range_weights
from actcore.config import config


@pytest.fixture(autouse=True)
def _small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "min_numel", 0)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4)
    )


def _heterogeneous_batch(n: int = 16) -> torch.Tensor:
    """Samples whose scales span three orders of magnitude."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 64, generator=g) * torch.logspace(-2, 1, n)[:, None]


def _train(model: nn.Module, steps: int) -> None:
    x = _heterogeneous_batch()
    for _ in range(steps):
        model.zero_grad()
        model(x).square().mean().backward()


def test_convert_attaches_at_adaptive_levels_only() -> None:
    model = actcore.convert(_model(), level="L3")
    scheme = model.act_adaptive
    assert isinstance(scheme, AdaptiveBits)
    assert all(model[i].act_scheme is scheme for i in (0, 1, 3, 4))
    actcore.convert(model, level="L3.1")
    assert model.act_adaptive is scheme  # idempotent: the same plan survives
    actcore.convert(model, level="L2")
    assert model.act_adaptive is None and model[0].act_scheme is None


def test_plan_respects_budget_and_beats_uniform() -> None:
    model = actcore.convert(_model(), level="L3")
    scheme = model.act_adaptive
    scheme.interval = 4
    _train(model, 9)  # the plan is recomputed at steps 4 and 8
    plans = {name: st.plan for name, st in scheme.layers.items()}
    assert all(plans.values()), plans
    assert scheme.average_bits() <= scheme.budget + 1e-9
    assert scheme.average_bits() > scheme.budget - 0.5  # the budget is used, not wasted
    uniform = {name: [2] * len(plan) for name, plan in plans.items()}
    assert scheme.predicted_variance() < 0.5 * scheme.predicted_variance(uniform)
    # the first layer's samples differ in scale: the largest get more bits than the smallest
    first = plans["0"]
    assert first == sorted(first, reverse=True) and first[0] > first[-1]
    # per-sample plans for plain inputs; one width for the zero-value (after ReLU) input
    assert not scheme.layers["0"].zero_value and scheme.layers["3"].zero_value
    assert len(set(plans["3"])) == 1


def _brute_force(weights: list[float], costs: list[float], budget: float, top: int) -> float:
    best = float("inf")
    limit = budget * sum(costs)
    for bits in itertools.product(range(1, top + 1), repeat=len(weights)):
        if sum(c * b for c, b in zip(costs, bits, strict=True)) <= limit + 1e-9:
            value = sum(w / (2**b - 1) ** 2 for w, b in zip(weights, bits, strict=True))
            best = min(best, value)
    return best


@pytest.mark.parametrize("budget", [1.5, 2.0, 3.0])
def test_allocation_is_optimal_on_small_instances(budget: float) -> None:
    """Equal costs per sample: greedy marginal gains give the exact integer optimum."""
    gen = torch.Generator().manual_seed(3)
    scheme = AdaptiveBits(budget=budget, max_bits=4)
    weights = (torch.rand(6, generator=gen) * 10).pow(3)
    scheme.layers["a"] = _LayerStats(
        sens=torch.tensor(4.0),
        profile=weights.sort(descending=True).values,
        elems=torch.tensor(1.0),
    )
    scheme.replan()
    w = [4.0 * float(v) / 4 for v in weights]
    assert scheme.predicted_variance() == pytest.approx(_brute_force(w, [1.0] * 6, budget, 4))
    assert scheme.average_bits() <= budget


def test_state_dict_round_trip_keeps_plan() -> None:
    model = actcore.convert(_model(), level="L3")
    model.act_adaptive.interval = 3
    _train(model, 4)
    state = model.act_adaptive.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = actcore.convert(_model(), level="L3")
    resumed.act_adaptive.load_state_dict(torch.load(buffer))
    a, b = model.act_adaptive, resumed.act_adaptive
    assert {n: s.plan for n, s in a.layers.items()} == {n: s.plan for n, s in b.layers.items()}
    assert a.steps == b.steps and a.predicted_variance() == b.predicted_variance()
    x = _heterogeneous_batch()
    assert a.compressor(model[0], "conv", x, 2, None) == b.compressor(
        resumed[0], "conv", x, 2, None
    )


def test_per_sample_quantize_round_trip() -> None:
    x = _heterogeneous_batch(8).view(8, 4, 16)
    comp = PerSampleQuantize(((4, 2), (2, 3), (1, 3)), group_size=64)
    tensors, meta = comp.pack(x)
    y = comp.unpack(tensors, meta)
    assert y.shape == x.shape and y.dtype == x.dtype
    order = sample_range_weights(x, 64).argsort(descending=True)
    bits = torch.empty(8, dtype=torch.long)
    bits[order] = torch.tensor([4, 4, 2, 2, 2, 1, 1, 1])
    flat = x.reshape(8, -1)
    step = (flat.amax(1) - flat.amin(1)) * 1.02 / (2.0**bits - 1)
    err = (y - x).reshape(8, -1).abs().amax(1)
    assert (err <= step).all()
    with pytest.raises(ValueError, match="do not cover a batch of 8"):
        PerSampleQuantize(((2, 5),)).pack(x)
    # all samples at one width is the plain per-sample quantizer's storage
    single, _ = PerSampleQuantize(((2, 8),), group_size=64).pack(x)
    plain, _ = Quantize(2, 64).pack(x)
    assert sum(t.nbytes for t in single[1:]) == sum(t.nbytes for t in plain)


def test_mixed_bits_gradient_unbiased() -> None:
    """With a mixed plan, the weight gradient stays unbiased (bound from each sample's bits)."""
    torch.manual_seed(0)
    ref = nn.Linear(64, 8)
    q = actcore.convert(copy.deepcopy(ref), level="L3")
    scheme = q.act_adaptive
    plan = [4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    scheme.layers["0" if "0" in scheme.layers else ""].plan = plan
    x = _heterogeneous_batch().requires_grad_(True)
    w = torch.randn(16, 8)
    (ref(x) * w).sum().backward()
    n, total, single = 120, 0, None
    for _ in range(n):
        q.zero_grad()
        (q(x) * w).sum().backward()
        g = q.weight.grad.clone()
        single = g if single is None else single
        total = total + g
    order = sample_range_weights(x, config.group_size).argsort(descending=True)
    bits = torch.empty(16)
    bits[order] = torch.tensor(plan, dtype=torch.float)
    flat = x.detach()
    step = (flat.amax(1) - flat.amin(1)) * 1.02 / (2**bits - 1)
    var = (w.square() * (step.square() / 4)[:, None]).sum(0)[:, None].expand(8, 64)
    err = (total / n - ref.weight.grad).abs()
    assert (single - ref.weight.grad).abs().max() > 0
    assert (err / (var / n).sqrt()).max() < 5.0


def test_no_host_reads_between_replans(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that does not replan reads nothing back from tensors (no device sync)."""
    model = actcore.convert(_model(), level="L3")
    model.act_adaptive.interval = 3
    _train(model, 4)  # one replan at step 3; step 5 below does not replan

    def refuse(*args, **kwargs):
        raise AssertionError("host read of a tensor value during a step")

    for name in ("item", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    _train(model, 1)


def test_steps_counted_when_first_layer_saves_nothing() -> None:
    """A frozen first layer saves no input: the step count (and replanning) still advances."""
    model = actcore.convert(_model(), level="L3")
    model[0].requires_grad_(False)
    scheme = model.act_adaptive
    scheme.interval = 2
    _train(model, 5)
    assert scheme.steps == 5
    assert not scheme.layers["0"].plan and scheme.layers["3"].plan and scheme.layers["4"].plan
