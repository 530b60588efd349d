"""fit_budget(order="time"): levels and recomputed blocks chosen together by a knapsack over
measured step times and gradient errors; the time model reproduces the steps it was
measured on; the plan fits each budget, keeps what it predicted, never more as the budget
falls; recompute is chosen where it costs less than compression and not otherwise; Q-layers
fed one tensor take one level; the model scope is switched per block (exact: plain
gradients, bitwise), and turned on where it costs less than recompute."""

from __future__ import annotations

import copy
import dataclasses
import statistics

import pytest
import torch
import torch.nn.functional as F
import torchvision
from gated_net import Gated
from torch import nn

import actcore
from actcore.budget import MemoryPlan, candidate_blocks, fit_budget, forget_times
from actcore.budget import search as budget_search
from actcore.budget.costs import StepTimes, step_times
from actcore.budget.fastest import shared_inputs
from actcore.layers.base import QLayer
from actcore.memory import profiled_bytes, track

LEVELS = ["L0", "L1", "L2", "L3"]


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.bn(self.conv1(x))))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.Sequential(*(_Block(16) for _ in range(3))),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


_X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
_Y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))


def _loss(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(_X), _Y)


def _kept(model: nn.Module) -> int:
    """What one forward of the planning loss keeps (as the planner measures it)."""
    with track(model) as report:
        out = _loss(model)
    del out
    return report.retained_bytes


def _layers(model: nn.Module) -> dict[str, QLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QLayer)}


def test_the_time_model_reproduces_the_steps_it_was_measured_on(monkeypatch):
    from actcore.budget import costs

    model = actcore.convert(_net(), level="L0")
    layers, blocks = _layers(model), candidate_blocks(model)
    seconds: list[float] = []
    real = costs._step

    def recorded(*args):
        taken, by_module = real(*args)
        seconds.append(taken)
        return taken, by_module

    monkeypatch.setattr(costs, "_step", recorded)
    times = step_times(model, layers, _loss, LEVELS, blocks, rounds=3)
    configs = len(LEVELS) + 1  # each level, then every block recomputed
    rounds = [seconds[r * configs : (r + 1) * configs] for r in range(1, 4)]  # after warm-up

    def paired(i: int) -> float:  # config i's extra over exact, within each round
        return statistics.median(r[i] - r[0] for r in rounds)

    assert len(times.uniform) == len(LEVELS) and times.recomputed is not None
    assert times.exact == statistics.median(r[0] for r in rounds)
    assert times.predict(dict.fromkeys(layers, 0), []) == times.exact
    for i in range(1, len(LEVELS)):  # the measured extra (more only where it measured less
        predicted = times.predict(dict.fromkeys(layers, i), [])  # than the layers' longer
        assert predicted >= times.exact + paired(i) - 1e-9  # forwards: noise)
    every = times.predict(dict.fromkeys(layers, 0), blocks)
    assert every == pytest.approx(times.exact + max(0.0, paired(len(LEVELS))), abs=1e-9)
    assert all(v >= 0 for table in times.layer for v in table.values())
    assert all(v >= 0 for v in times.block.values())
    # the measuring left the model as it was: exact, nothing recomputed, no hooks
    assert {m.act_level for m in layers.values()} == {"L0"}
    assert not any("forward" in model.get_submodule(b).__dict__ for b in blocks)
    assert all(not m._forward_pre_hooks for m in layers.values())


def test_a_time_plan_fits_each_budget_keeps_what_it_predicted_and_never_more_as_it_falls():
    model = actcore.convert(_net(), level="L0")
    top = fit_budget(model, _loss, 2**62, recompute=False, order="bytes")
    last = None
    for share in (0.9, 0.7, 0.55, 0.45, 0.37):
        budget = int(top.exact_bytes * share)
        plan = fit_budget(model, _loss, budget, order="time")
        assert plan.order == "time" and plan.smallest_bytes <= plan.kept_bytes <= budget
        assert plan.kept_bytes == _kept(model)  # the plan is set on the model
        assert plan.predicted_bytes == pytest.approx(plan.kept_bytes, rel=0.02)
        assert plan.step_seconds is not None and plan.exact_seconds is not None
        assert plan.step_seconds >= plan.exact_seconds
        if last is not None:
            assert plan.kept_bytes <= last.kept_bytes
        last = plan
    held = profiled_bytes(lambda: _loss(model))[1]  # an independent measure of the last plan
    assert abs(held - last.kept_bytes) <= max(4096, 0.05 * last.kept_bytes)


def _priced(layer_seconds: float, block_seconds: float):
    """A stand-in for the measured times: every Q-layer at a coarser level, and every block
    recomputed, adds the given seconds to a 1 s step."""

    def fake(model, layers, example_inputs, forward, names, blocks, *scope):
        layer = [dict.fromkeys(layers, 0.0)] + [
            dict.fromkeys(layers, layer_seconds) for _ in names[1:]
        ]
        return StepTimes(1.0, layer, dict.fromkeys(blocks, block_seconds), [1.0] * len(names), 1.0)

    return fake


@pytest.mark.parametrize("recompute_is_cheap", [True, False])
def test_recompute_is_chosen_where_it_costs_less_than_compression(monkeypatch, recompute_is_cheap):
    model = actcore.convert(_net(), level="L0")
    top = fit_budget(model, _loss, 2**62, recompute=False, order="bytes")
    budget = int(top.exact_bytes * 0.45)  # the coarsest level alone fits too
    levels_only = fit_budget(model, _loss, budget, recompute=False, order="bytes")
    assert levels_only.kept_bytes <= budget
    seconds = (10.0, 0.01) if recompute_is_cheap else (0.01, 10.0)
    monkeypatch.setattr(budget_search, "cached_step_times", _priced(*seconds))
    plan = fit_budget(model, _loss, budget, order="time", error_weight=0.0)
    assert plan.kept_bytes <= budget
    if recompute_is_cheap:
        assert plan.recompute  # though levels alone fit
        assert all(plan.levels[n] == "L0" for n in plan.levels if n.startswith("1."))
    else:
        assert not plan.recompute


def test_a_heavy_error_weight_trades_compression_for_recompute(monkeypatch):
    model = actcore.convert(_net(), level="L0")
    top = fit_budget(model, _loss, 2**62, recompute=False, order="bytes")
    budget = int(top.exact_bytes * 0.45)
    monkeypatch.setattr(budget_search, "cached_step_times", _priced(0.01, 0.05))
    light = fit_budget(model, _loss, budget, order="time", error_weight=1e-9)
    heavy = fit_budget(model, _loss, budget, order="time", error_weight=1e6)
    assert light.gradient_error is not None and heavy.gradient_error is not None
    assert heavy.gradient_error < light.gradient_error
    assert len(heavy.recompute) > len(light.recompute)


def test_a_downsampling_conv_takes_its_block_convs_level():
    torch.manual_seed(0)
    model = actcore.convert(torchvision.models.resnet18(num_classes=10), level="L0")
    x = torch.randn(2, 3, 32, 32)
    groups = shared_inputs(model, _layers(model), lambda m: m(x))
    for stage in ("layer2", "layer3", "layer4"):
        assert [f"{stage}.0.conv1", f"{stage}.0.downsample.0"] in groups
    top = fit_budget(model, x, 2**62, recompute=False, order="bytes")
    plan = fit_budget(model, x, int(top.exact_bytes * 0.5), order="time")
    for stage in ("layer2", "layer3", "layer4"):
        assert plan.levels[f"{stage}.0.conv1"] == plan.levels[f"{stage}.0.downsample.0"]
    assert plan.predicted_bytes == pytest.approx(plan.kept_bytes, rel=0.02)


def test_the_time_plan_is_saved_and_restored_whole():
    model = actcore.convert(_net(), level="L0")
    top = fit_budget(model, _loss, 2**62, recompute=False, order="bytes")
    plan = fit_budget(model, _loss, int(top.exact_bytes * 0.4), order="time")
    again = MemoryPlan.from_state_dict(plan.state_dict())
    assert again == plan
    assert "x exact's (predicted)" in str(plan)
    fresh = actcore.convert(_net(), level="L0")
    actcore.resume.load_state_dict(fresh, actcore.resume.state_dict(model))
    assert _kept(fresh) == plan.kept_bytes


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_error_weight_is_refused(weight):
    model = actcore.convert(_net(), level="L0")
    with pytest.raises(ValueError, match="error_weight must be a finite number >= 0"):
        fit_budget(model, _loss, "50%", order="time", error_weight=weight)


def test_times_are_measured_once_per_shape_and_again_when_forgotten(monkeypatch):
    model = actcore.convert(_net(), level="L0")
    calls = []
    real = budget_search.cached_step_times.__globals__["step_times"]

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(budget_search.cached_step_times.__globals__, "step_times", counted)
    x = _X.clone()
    fit_budget(model, x, "40%", order="time")
    fit_budget(model, x, "40%", order="time")
    assert len(calls) == 1
    forget_times(model)
    fit_budget(model, x, "40%", order="time")
    assert len(calls) == 2
    fit_budget(model, torch.randn(2, 3, 16, 16), "40%", order="time")
    assert len(calls) == 3


def test_the_smallest_budget_is_named_when_none_fits():
    model = actcore.convert(_net(), level="L0")
    smallest = fit_budget(model, _loss, "1000%", order="time")  # exact, nothing to plan
    assert smallest.kept_bytes == smallest.exact_bytes
    plan = fit_budget(model, _loss, int(smallest.exact_bytes * 0.4), order="time")
    with pytest.raises(ValueError, match="the smallest budget that fits") as err:
        fit_budget(model, _loss, plan.smallest_bytes - 1, order="time")
    assert str(plan.smallest_bytes) in str(err.value)
    assert dataclasses.replace(plan).smallest_bytes == plan.smallest_bytes


def _gated_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Sequential(*(Gated(64) for _ in range(3))), nn.Linear(64, 8)
    )


_T = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(3))


def _gated_loss(model: nn.Module) -> torch.Tensor:
    return model(_T).square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    _gated_loss(model).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_an_unconverted_model_gets_a_scope_the_plan_switches_per_block():
    plain = _gated_net()
    model = copy.deepcopy(plain)
    plan = fit_budget(model, _gated_loss, "1000%", order="time")
    assert model.act_report.level == "L2" and model.act_scope is not None
    assert set(plan.scope) == {"", "1.0", "1.1", "1.2"} and not any(plan.scope.values())
    assert plan.kept_bytes == plan.exact_bytes == _kept_by(model, _gated_loss)
    for a, b in zip(_grads(plain), _grads(model), strict=True):
        assert torch.equal(a, b)  # exact: plain PyTorch's gradients, bitwise


def _kept_by(model: nn.Module, loss) -> int:
    with track(model) as report:
        out = loss(model)
    del out
    return report.retained_bytes


def _scope_priced(scope_seconds: float, block_seconds: float):
    def fake(model, layers, example_inputs, forward, names, blocks, units, set_scope):
        layer = [dict.fromkeys(layers, 0.0)] + [dict.fromkeys(layers, 10.0) for _ in names[1:]]
        return StepTimes(
            1.0,
            layer,
            dict.fromkeys(blocks, block_seconds),
            [1.0] * len(names),
            1.0,
            dict.fromkeys(units, scope_seconds),
            1.0,
        )

    return fake


@pytest.mark.parametrize("scope_is_cheap", [True, False])
def test_the_scope_is_switched_on_where_it_costs_less_than_recompute(monkeypatch, scope_is_cheap):
    plain = _gated_net()
    model = copy.deepcopy(plain)
    exact = fit_budget(model, _gated_loss, "1000%", order="time").exact_bytes
    budget = int(exact * 0.75)
    seconds = (0.01, 10.0) if scope_is_cheap else (10.0, 0.01)
    monkeypatch.setattr(budget_search, "cached_step_times", _scope_priced(*seconds))
    plan = fit_budget(model, _gated_loss, budget, order="time", error_weight=0.0)
    assert plan.kept_bytes <= budget and plan.kept_bytes == _kept_by(model, _gated_loss)
    assert set(plan.levels.values()) == {"L0"}  # the Q-layers' levels cost most here
    lines = plan.table().splitlines()
    assert sum("scope on" in line for line in lines) == sum(plan.scope.values())
    assert sum("scope on" in ln or "scope exact" in ln for ln in lines) == len(plan.scope) == 4
    if scope_is_cheap:
        assert any(plan.scope.values()) and not plan.recompute
    else:
        assert plan.recompute and not any(plan.scope.values())
        for a, b in zip(_grads(plain), _grads(model), strict=True):
            assert torch.equal(a, b)  # recompute alone: bitwise plain, as the issue asks
    again = MemoryPlan.from_state_dict(plan.state_dict())
    assert again.scope == plan.scope
    other = copy.deepcopy(plain)
    actcore.convert(other, level="L2")
    again.apply(other)
    assert _kept_by(other, _gated_loss) == plan.kept_bytes


def _packed_priced(packed_seconds: float):
    """Levels and the scope inside blocks cost most, recompute little, recompute with the
    input packed ``packed_seconds`` a block."""

    def fake(model, layers, example_inputs, forward, names, blocks, units, set_scope):
        layer = [dict.fromkeys(layers, 0.0)] + [dict.fromkeys(layers, 10.0) for _ in names[1:]]
        return StepTimes(
            1.0,
            layer,
            dict.fromkeys(blocks, 0.01),
            [1.0] * len(names),
            1.0,
            {u: 0.0 if u == "" else 10.0 for u in units},
            1.0,
            dict.fromkeys(blocks, packed_seconds),
            1.0,
        )

    return fake


def test_a_recomputed_block_s_input_is_packed_where_recompute_alone_keeps_too_much(monkeypatch):
    plain = _gated_net()
    model = copy.deepcopy(plain)
    fit_budget(model, _gated_loss, "1000%", order="time")
    monkeypatch.setattr(budget_search, "cached_step_times", _packed_priced(0.02))
    # what every block recomputed keeps, its input exact, and the rest's scope on
    recomputed = fit_budget(model, _gated_loss, "1000%", order="time")
    alone = fit_budget(model, _gated_loss, int(0.5 * recomputed.exact_bytes), order="time")
    assert alone.recompute and not any(alone.scope.get(b) for b in alone.recompute)
    for a, b in zip(_grads(plain), _grads(model), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # no compression inside the blocks
    budget = alone.kept_bytes - 1  # recompute alone no longer fits: pack some inputs
    plan = fit_budget(model, _gated_loss, budget, order="time", error_weight=0.0)
    packed = [b for b in plan.recompute if plan.scope[b]]
    assert packed and plan.kept_bytes <= budget
    assert plan.kept_bytes == _kept_by(model, _gated_loss)
    assert plan.predicted_bytes == pytest.approx(plan.kept_bytes, rel=0.02)
    assert set(plan.levels.values()) == {"L0"}  # the levels cost most
    assert "input packed" in plan.describe() and "its input packed" in plan.table()
    step = plan.step_seconds - 1.0  # the recomputes and what the rest's scope adds
    assert step == pytest.approx(0.02 * len(packed) + 0.01 * (len(plan.recompute) - len(packed)))
    cosine = F.cosine_similarity(
        torch.cat([g.flatten() for g in _grads(model)]),
        torch.cat([g.flatten() for g in _grads(plain)]),
        dim=0,
    )
    assert 0.9 < cosine < 1.0  # the packed inputs are compressed: close, not exact
    again = MemoryPlan.from_state_dict(plan.state_dict())
    other = actcore.convert(copy.deepcopy(plain), level="L2")
    again.apply(other)
    assert _kept_by(other, _gated_loss) == plan.kept_bytes


def test_packed_recompute_is_timed_and_its_error_measured(monkeypatch):
    model = actcore.convert(_gated_net(), level="L2")
    layers, blocks = _layers(model), candidate_blocks(model)
    units = ["", *blocks]

    def set_scope(on):
        for u in units:
            actcore.layers.scope.set_scope_exact(model.get_submodule(u), u not in on)

    times = step_times(model, layers, _gated_loss, LEVELS, blocks, 2, units, set_scope)
    assert set(times.packed) == set(blocks) and times.recomputed_packed is not None
    for b in blocks:  # recompute and the packing: at least recompute alone
        assert times.packed[b] >= times.block[b] > 0
    every = times.predict(dict.fromkeys(layers, 0), blocks, blocks)
    assert every == pytest.approx(times.exact + sum(times.packed.values()))
    assert every >= times.recomputed_packed - 1e-12
    probed = []
    real = budget_search.cached_scope_errors

    def recorded(*args, **kwargs):
        table = real(*args, **kwargs)
        probed.append((kwargs.get("variant", "scope"), table))
        return table

    monkeypatch.setattr(budget_search, "cached_scope_errors", recorded)
    plan = fit_budget(model, _gated_loss, "40%", order="time")
    assert plan.kept_bytes <= plan.budget and plan.gradient_error is not None
    variants = dict(probed)
    assert set(variants) == {"scope", "recomputed"}
    assert set(variants["recomputed"]) == set(blocks)  # each block's packed input: an error
    assert all(e > 0 for e in variants["recomputed"].values())


def test_a_model_converted_at_an_adaptive_level_is_refused_for_the_time_order():
    model = actcore.convert(_gated_net(), level="L3")
    with pytest.raises(ValueError, match="adaptive bits"):
        fit_budget(model, _gated_loss, "50%", order="time")


def test_where_lowering_by_the_excess_does_not_settle_the_cheapest_fitting_target_is_found():
    """Bytes that do not add up (layer a at L3 with b exact keeps 1000 bytes more than the
    tables say): the first solution overshoots past every target, and a bisection over the
    target finds the cheapest solution that fits, not the lightest configuration."""
    from actcore.budget.fastest import Problem, fastest_plan

    bytes_at = {"L0": 100, "L3": 10}

    def kept(config):
        by_module = {n: bytes_at[lv] for n, lv in config.items()}
        total = sum(by_module.values())
        if config["a"] == "L3" and config["b"] == "L0":
            total += 1000
        return total, by_module

    times = StepTimes(
        1.0, [dict.fromkeys("abc", 0.0), {"a": 1.0, "b": 5.0, "c": 6.0}], {}, [1.0, 1.0], None
    )
    problem = Problem(
        kept, [], [], ["a", "b", "c"], ["L0", "L3"], [], [], [], times, None, None, 0.0, 0.0
    )
    plan = fastest_plan(problem, 215)
    assert plan.kept_bytes <= 215 and plan.predicted_bytes == plan.kept_bytes == 120
    assert plan.levels == {"a": "L3", "b": "L3", "c": "L0"}  # cost 6; the lightest costs 12
    assert plan.smallest_bytes == 30


def test_where_a_solution_keeps_well_under_its_budget_a_cheaper_one_that_fits_is_found():
    """Bytes that over-count (layer a at L3 packs 60 bytes fewer than its table says, what
    a layer sharing a packing with the scope does): the first solution keeps far under the
    budget, and one for a target raised by that slack is cheaper and still fits."""
    from actcore.budget.fastest import Problem, fastest_plan

    bytes_at = {"L0": 100, "L3": 10}

    def kept(config):
        by_module = {n: bytes_at[lv] for n, lv in config.items()}
        return sum(by_module.values()) - (60 if config["a"] == "L3" else 0), by_module

    times = StepTimes(
        1.0, [dict.fromkeys("abc", 0.0), {"a": 1.0, "b": 2.0, "c": 6.0}], {}, [1.0, 1.0], None
    )
    problem = Problem(
        kept, [], [], ["a", "b", "c"], ["L0", "L3"], [], [], [], times, None, None, 0.0, 0.0
    )
    plan = fastest_plan(problem, 170)  # the tables: a and b at L3 (120 bytes; 60 measured)
    assert plan.levels == {"a": "L3", "b": "L0", "c": "L0"}  # cost 1 against 3
    assert plan.kept_bytes == 150 <= 170 and plan.predicted_bytes == 210


def test_max_batch_by_the_time_order_plans_the_size_it_finds():
    model = _gated_net()

    def inputs(batch: int):
        t = torch.randn(batch, 16, 32, generator=torch.Generator().manual_seed(4))
        return lambda m: m(t).square().mean()

    size, plan = actcore.max_batch(model, inputs, "150KiB", order="time", limit=64)
    assert model.act_report.level == "L2" and plan.order == "time"
    assert 1 <= size < 64 and plan.kept_bytes <= 150 * 1024
    assert plan.kept_bytes == _kept_by(model, inputs(size))
