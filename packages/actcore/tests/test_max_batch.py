"""actcore.max_batch / max_seq: the largest size whose forward, every Q-layer at the
coarsest level, keeps at most the budget (checked against a brute-force sweep of sizes),
planned at that size; steps of ``multiple_of``; a clear error where nothing fits; no trace
left by the planning forwards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import actcore
from actcore.layers.base import QLayer
from actcore.memory import track


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))


class _TokenMLP(nn.Module):
    """A sequence model: embedding, two linear layers per token, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))


def _coarsest_kept(model: nn.Module, inputs: torch.Tensor) -> int:
    """What a forward keeps with every Q-layer of a copy of ``model`` (converted at L0) at
    L3: the planner's feasibility measure, computed independently."""
    probe = copy.deepcopy(model)
    for m in probe.modules():
        if isinstance(m, QLayer):
            m.act_level = "L3"
    torch.manual_seed(0)
    with track(probe) as report:
        out = probe(inputs)
    del out
    return report.retained_bytes


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_max_batch_is_the_largest_batch_that_fits_and_is_planned(multiple_of):
    model = actcore.convert(_net(), level="L0")
    kept = {b: _coarsest_kept(model, _images(b)) for b in range(1, 33)}
    budget = (kept[9] + kept[10]) // 2  # between batch 9 and 10 (bytes grow with the batch)
    assert kept[9] <= budget < kept[10]
    size, plan = actcore.max_batch(model, _images, budget, multiple_of=multiple_of)
    expected = max(b for b in kept if kept[b] <= budget and b % multiple_of == 0)
    assert size == expected
    assert kept[size + multiple_of] > budget
    assert plan.kept_bytes <= budget
    with track(model) as report:  # the model is left at the plan for that batch
        out = model(_images(size))
    del out
    assert report.retained_bytes == plan.kept_bytes
    assert model.act_memory_plan is plan


def test_the_plan_for_the_size_found_takes_the_order_asked_for():
    model = actcore.convert(_net(), level="L0")
    budget = (_coarsest_kept(model, _images(6)) + _coarsest_kept(model, _images(7))) // 2
    by_error = actcore.max_batch(model, _images, budget)
    by_bytes = actcore.max_batch(model, _images, budget, order="bytes")
    assert by_error[0] == by_bytes[0] == 6  # the order changes the plan, not the size
    assert (by_error[1].order, by_bytes[1].order) == ("error", "bytes")
    assert by_error[1].gradient_error is not None and by_bytes[1].gradient_error is None
    assert by_bytes[1].kept_bytes <= budget


def test_max_seq_finds_the_longest_sequence_in_steps():
    model = actcore.convert(_TokenMLP(), level="L0")
    budget = _coarsest_kept(model, _tokens(200))
    length, plan = actcore.max_seq(model, _tokens, budget, start=8, multiple_of=8)
    assert length % 8 == 0
    assert _coarsest_kept(model, _tokens(length)) <= budget
    assert _coarsest_kept(model, _tokens(length + 8)) > budget
    assert 192 <= length <= 200 and plan.kept_bytes <= budget


def test_the_limit_caps_the_search():
    model = actcore.convert(_net(), level="L0")
    size, plan = actcore.max_batch(model, _images, "1 GiB", limit=12)
    assert size == 12 and set(plan.levels.values()) == {"L0"}  # at 12 the budget keeps all exact


def test_nothing_fitting_is_refused_naming_what_the_start_keeps():
    model = actcore.convert(_net(), level="L0")
    with pytest.raises(
        ValueError, match=r"no batch fits a budget of .*a batch of 2 keeps at least"
    ):
        actcore.max_batch(model, _images, 100, start=2)
    assert all(m.act_level == "L0" for m in model.modules() if isinstance(m, QLayer))


def test_planning_leaves_no_trace():
    model = actcore.convert(_net(), level="L0")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    actcore.max_batch(model, _images, "64 KiB", limit=64)
    drawn = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(2))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # batch-norm statistics too


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 0}, "start must be a positive int"),
        ({"limit": 2.5}, "limit must be a positive int"),
        ({"multiple_of": 4, "start": 6}, r"start \(6\) must be a multiple of multiple_of \(4\)"),
        ({"start": 10, "limit": 5}, "at most limit"),
        ({"order": "speed"}, r"order must be one of \('error', 'bytes', 'time'\), got 'speed'"),
    ],
)
def test_bad_search_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        actcore.max_batch(_net(), _images, "1MiB", **kwargs)


def test_the_default_budget_needs_a_cuda_model():
    with pytest.raises(ValueError, match=r"on cpu: give a budget"):
        actcore.max_batch(_net(), _images)
