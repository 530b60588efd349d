"""A budget on a whole training step's peak (``bound="peak"``): ``step_peak`` against the
profiler's own records, plans whose measured step stays within each budget of a sweep and
keep no more as it falls, the error naming the least plan's peak, ``max_batch`` on the peak
against a brute-force sweep, and sizes or configurations that run out of device memory
counted as not fitting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcore
from actcore.budget import MemoryPlan, step_peak
from actcore.budget.plan import OUT_OF_MEMORY
from actcore.layers.base import QLayer
from actcore.memory import profiled_peak_bytes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))


def _at(model: nn.Module, level: str) -> nn.Module:
    """Every Q-layer of ``model`` at ``level`` (the least plan, for L3)."""
    for m in model.modules():
        if isinstance(m, QLayer):
            m.act_level = level
    return model


def _independent_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The profiler's peak of one forward + backward, gradients allocated before it."""
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(0)
    _, peak = profiled_peak_bytes(lambda: model(x).backward(torch.ones(len(x), 10)))
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    return peak


def test_step_peak_is_the_profilers_and_gives_the_gradients_back():
    model = actcore.convert(_net(), level="L0")
    x = _images(4)
    model[-1].weight.grad = torch.full_like(model[-1].weight, 3.0)
    peak = step_peak(model, lambda m: m(x))
    assert peak == _independent_peak(model, x)
    # the kept activations are part of the peak: at least what a forward keeps
    with actcore.memory.track(model) as report:
        out = model(x)
    del out
    assert peak >= report.retained_bytes > 0
    assert torch.equal(model[-1].weight.grad, torch.full_like(model[-1].weight, 3.0))
    assert all(p.grad is None for p in model[0].parameters())


def test_step_peak_backs_up_from_a_loss_in_a_mapping_and_refuses_no_grad_outputs():
    model = _net()
    x = _images(2)
    peak = step_peak(model, lambda m: {"logits": m(x), "loss": m(x).square().mean()})
    assert peak > 0
    with pytest.raises(ValueError, match="requires grad"):
        step_peak(model, lambda m: m(x).detach())


def test_a_sweep_of_peak_budgets_fits_each_step_and_keeps_no_more_as_it_falls():
    model = actcore.convert(_net(), level="L0")
    x = _images(8)
    forward = lambda m: m(x)  # noqa: E731
    exact_peak = step_peak(model, forward)
    least_peak = step_peak(_at(model, "L3"), forward)
    _at(model, "L0")
    assert least_peak < exact_peak
    kept = []
    for i in range(6):
        budget = int(exact_peak - (exact_peak - least_peak) * i / 5)
        plan = actcore.fit_budget(model, forward, budget, recompute=False, bound="peak")
        assert plan.bound == "peak" and plan.budget == budget
        assert plan.peak_bytes <= budget
        assert _independent_peak(model, x) == plan.peak_bytes  # the plan is set on the model
        kept.append(plan.kept_bytes)
    assert kept == sorted(kept, reverse=True)
    assert kept[0] > kept[-1]


def test_a_peak_below_the_least_plans_step_is_refused_naming_that_peak():
    model = actcore.convert(_net(), level="L0")
    x = _images(8)
    least_peak = step_peak(_at(model, "L3"), lambda m: m(x))
    _at(model, "L0")
    with pytest.raises(ValueError, match=rf"peaks at .*\({least_peak} bytes\)"):
        actcore.fit_budget(model, lambda m: m(x), least_peak - 1, recompute=False, bound="peak")


def test_bad_bounds_are_refused_and_the_bound_is_saved_with_the_plan():
    model = actcore.convert(_net(), level="L0")
    with pytest.raises(ValueError, match="bound must be one of"):
        actcore.fit_budget(model, _images(2), "1MiB", bound="step")
    with pytest.raises(ValueError, match="bound must be one of"):
        actcore.max_batch(model, _images, "1MiB", bound="peaks")
    x = _images(4)
    peak = step_peak(model, lambda m: m(x))
    plan = actcore.fit_budget(model, x, peak, recompute=False, bound="peak")
    again = MemoryPlan.from_state_dict(plan.state_dict())
    assert again == plan and again.bound == "peak" and again.peak_bytes == plan.peak_bytes
    old = {k: v for k, v in plan.state_dict().items() if k not in ("bound", "peak_bytes")}
    assert MemoryPlan.from_state_dict(old).bound == "kept"
    assert "peaking at" in str(plan)


def test_max_batch_on_the_peak_is_the_largest_batch_whose_least_step_fits():
    model = actcore.convert(_net(), level="L0")
    least = {b: step_peak(_at(model, "L3"), lambda m, b=b: m(_images(b))) for b in range(1, 17)}
    _at(model, "L0")
    budget = (least[6] + least[7]) // 2
    assert least[6] <= budget < least[7]
    size, plan = actcore.max_batch(model, _images, budget, recompute=False, bound="peak")
    assert size == max(b for b in least if least[b] <= budget)
    assert plan.bound == "peak" and plan.peak_bytes <= budget
    # on the bytes kept alone, the same budget admits a larger batch
    kept_size, _ = actcore.max_batch(model, _images, budget, recompute=False)
    assert kept_size > size


class _Oom(nn.Module):
    """Raises CUDA's out-of-memory error for batches over ``most`` (as a device would)."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.most:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (batch {len(x)})")
        return x


def test_sizes_whose_forward_runs_out_of_memory_do_not_fit():
    model = actcore.convert(nn.Sequential(_Oom(12), *_net()), level="L0")
    size, plan = actcore.max_batch(model, _images, "1TiB", recompute=False)
    assert size == 12 and plan.kept_bytes > 0
    with pytest.raises(ValueError, match="runs out of device memory"):
        actcore.max_batch(model, _images, "1TiB", start=16, recompute=False)


class _OomWhenExact(nn.Module):
    """Raises CUDA's out-of-memory error while ``layer`` is at L0."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer.act_level == "L0":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return x


def test_a_configuration_that_runs_out_of_memory_is_never_the_plan():
    net = actcore.convert(_net(), level="L0")
    model = nn.Sequential(_OomWhenExact(net[3]), *net)
    plan = actcore.fit_budget(model, _images(4), "1TiB", recompute=False)
    assert plan.order == "bytes"  # the exact probe step of the error order ran out too
    name = next(n for n, m in model.named_modules() if m is net[3])
    assert plan.levels[name] != "L0"
    assert plan.exact_bytes == OUT_OF_MEMORY
    assert "exact runs out of device memory" in str(plan)


def test_a_share_of_the_exact_step_peak_is_that_share_of_its_measured_peak():
    x = _images(4)
    exact_peak = step_peak(actcore.convert(_net(), level="L0"), lambda m: m(x))
    plan = actcore.fit_budget(_net(), x, "90%", bound="peak")
    assert plan.budget == int(0.9 * exact_peak)
    assert plan.peak_bytes is not None and plan.peak_bytes <= plan.budget
    assert set(plan.levels.values()) != {"L0"}  # the share is below what exact peaks at
