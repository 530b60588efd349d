"""Recompute in the memory plan: blocks checkpointed in place (names, state_dict keys and
gradients unchanged, dropout replayed), chosen by fit_budget only where the coarsest level
alone keeps too much, the fewest that fit; measured by ACT's tracker and the profiler;
saved and restored with the plan; undone by converting again."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import actcore
from actcore.budget import candidate_blocks, fit_budget, recomputed_blocks, set_recompute
from actcore.layers.base import QLayer
from actcore.memory import profiled_bytes, track


class _Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.conv2(F.relu(self.bn(self.conv1(x)))))


def _net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.Sequential(*(_Block(16, dropout) for _ in range(3))),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _x() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _y() -> torch.Tensor:
    return torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))


def _kept(model: nn.Module, x: torch.Tensor) -> int:
    with track(model) as report:
        out = model(x)
    del out
    return report.retained_bytes


def _floors(x: torch.Tensor) -> tuple[int, int]:
    """What a forward of the converted net keeps with every Q-layer at L3, and with every
    block recomputed as well (the Q-layers inside them at L0): computed independently."""
    model = actcore.convert(_net(), level="L0")
    for m in model.modules():
        if isinstance(m, QLayer):
            m.act_level = "L3"
    levels_only = _kept(model, x)
    for name in candidate_blocks(model):
        block = model.get_submodule(name)
        set_recompute(block, True)
        for m in block.modules():
            if isinstance(m, QLayer):
                m.act_level = "L0"
    return levels_only, _kept(model, x)


def _grads(model: nn.Module, seed: int = 7) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)
    F.cross_entropy(model(_x()), _y()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_candidate_blocks_are_the_blocks_of_the_stages():
    resnet = torchvision.models.resnet18()
    assert candidate_blocks(resnet) == [f"layer{i}.{j}" for i in (1, 2, 3, 4) for j in (0, 1)]
    assert candidate_blocks(_net()) == ["1.0", "1.1", "1.2"]
    assert candidate_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == []


def test_a_recomputed_block_keeps_its_names_and_gradients_and_replays_dropout():
    plain = _net(dropout=0.3)
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    for name in candidate_blocks(model):
        set_recompute(model.get_submodule(name), True)
    assert recomputed_blocks(model) == ["1.0", "1.1", "1.2"]
    assert list(model.state_dict()) == keys
    for a, b in zip(_grads(plain), _grads(model), strict=True):
        assert torch.equal(a, b)  # the recomputed dropout draws the same mask
    assert _kept(model, _x()) < _kept(plain, _x()) / 2
    clone = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert recomputed_blocks(clone) == ["1.0", "1.1", "1.2"]
    for a, b in zip(_grads(plain), _grads(clone), strict=True):
        assert torch.equal(a, b)
    for name in candidate_blocks(model):
        set_recompute(model.get_submodule(name), False)
    assert recomputed_blocks(model) == []
    assert _kept(model, _x()) == _kept(plain, _x())


def test_a_module_with_its_own_instance_forward_is_refused():
    block = _Block(4)
    block.forward = lambda x: x
    with pytest.raises(ValueError, match="its instance already has its own forward"):
        set_recompute(block, True)


def test_recompute_is_used_only_where_the_levels_alone_do_not_fit():
    x = _x()
    levels_only = fit_budget(_net(), x, 10**9, recompute=False)
    assert levels_only.recompute == ()
    model = _net()
    plan = fit_budget(model, x, levels_only.smallest_bytes)  # the levels alone reach it
    assert plan.recompute == () and recomputed_blocks(model) == []
    with pytest.raises(ValueError, match=r"cannot be met: with every Q-layer at L3 .* keeps"):
        fit_budget(_net(), x, levels_only.smallest_bytes - 1, recompute=False)


def test_a_budget_below_the_coarsest_level_recomputes_the_fewest_blocks_that_fit():
    x = _x()
    levels_only, all_recomputed = _floors(x)
    assert all_recomputed < levels_only  # (a recomputed block keeps its input exact)
    budget = levels_only - (levels_only - all_recomputed) // 3
    model = _net()
    plan = fit_budget(model, x, budget)
    assert 1 <= len(plan.recompute) < 3 and plan.kept_bytes <= budget
    assert plan.smallest_bytes == all_recomputed
    assert recomputed_blocks(model) == sorted(plan.recompute)
    assert _kept(model, x) == plan.kept_bytes  # the model is left at the plan
    for name, level in plan.levels.items():  # the Q-layers inside a recomputed block: exact
        if any(name.startswith(b + ".") for b in plan.recompute):
            assert level == "L0"
    out, profiled = profiled_bytes(model, x)  # the profiler's independent count agrees
    input_kept = x.numel() * 4 if plan.levels["0"] == "L0" else 0
    assert abs(profiled - (plan.kept_bytes + out.numel() * 4 - input_kept)) <= 1024
    del out
    # one block fewer (the one recomputed last) does not fit at the coarsest level
    fewer = copy.deepcopy(model)
    set_recompute(fewer.get_submodule(plan.recompute[-1]), False)
    for m in fewer.modules():
        if isinstance(m, QLayer):
            m.act_level = "L3"
    assert _kept(fewer, x) > budget
    assert "blocks recomputed" in str(plan)
    rows = {line.split()[0]: line for line in plan.table().splitlines()[3:]}
    for name in plan.levels:
        block = next((b for b in plan.recompute if name.startswith(b + ".")), None)
        assert (f"recomputed with {block}" in rows[name]) == (block is not None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), _y())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_budget_nothing_fits_names_the_smallest_with_every_block_recomputed():
    model = _net()
    _, all_recomputed = _floors(_x())
    with pytest.raises(ValueError, match=rf"keeps .* \({all_recomputed} bytes, every Q-layer "):
        fit_budget(model, _x(), 1000)
    assert recomputed_blocks(model) == []
    assert all(m.act_level == "L0" for m in model.modules() if isinstance(m, QLayer))


class _Narrowing(nn.Module):
    """A block whose wide input costs more kept exact than its layers keep compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.squeeze = nn.Linear(256, 8)
        self.out = nn.Linear(8, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.relu(self.squeeze(x)))


def test_blocks_whose_recompute_keeps_more_are_not_recomputed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(_Narrowing(), _Narrowing()), nn.Linear(256, 4))
    x = torch.randn(64, 256)
    smallest = fit_budget(copy.deepcopy(model), x, 10**9, recompute=False).smallest_bytes
    with pytest.raises(ValueError, match="recomputing any of the 2 blocks keeps more"):
        fit_budget(model, x, smallest - 1)
    assert recomputed_blocks(model) == []


def test_named_blocks_and_bad_names():
    x = _x()
    levels_only, _ = _floors(x)
    model = _net()
    plan = fit_budget(model, x, levels_only - 1, recompute=["1.2"])
    assert plan.recompute == ("1.2",)
    with pytest.raises(ValueError, match=r"cannot recompute \['nope'\].*its blocks: \['1.0'"):
        fit_budget(_net(), x, "1MiB", recompute=["nope"])
    with pytest.raises(TypeError, match="recompute is True, False or a list"):
        fit_budget(_net(), x, "1MiB", recompute="1.0")


def test_the_plan_resumes_with_its_blocks_and_converting_again_drops_them():
    x = _x()
    _, all_recomputed = _floors(x)
    model = _net()
    plan = fit_budget(model, x, all_recomputed)
    assert len(plan.recompute) == 3
    state = actcore.resume.state_dict(model)
    other = actcore.convert(_net(), level="L0")
    actcore.resume.load_state_dict(other, state)
    assert recomputed_blocks(other) == sorted(plan.recompute)
    assert _kept(other, x) == plan.kept_bytes
    actcore.convert(other, level="L0")
    assert recomputed_blocks(other) == []


def test_max_batch_reaches_further_with_recompute():
    def images(b: int) -> torch.Tensor:
        return torch.randn(b, 3, 16, 16, generator=torch.Generator().manual_seed(b))

    budget = fit_budget(_net(), images(8), 10**9, recompute=False).smallest_bytes
    without, _ = actcore.max_batch(_net(), images, budget, recompute=False, limit=64)
    model = _net()
    size, plan = actcore.max_batch(model, images, budget, limit=64)
    assert without in (8, 9)  # (what a batch keeps is close to linear in it)
    assert size > without and plan.kept_bytes <= budget and plan.recompute


def test_max_batch_is_not_held_back_by_blocks_whose_recompute_keeps_more():
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(_Narrowing(), _Narrowing()), nn.Linear(256, 4))

    def rows(b: int) -> torch.Tensor:
        return torch.randn(b, 256, generator=torch.Generator().manual_seed(b))

    budget = fit_budget(make(), rows(32), 10**9, recompute=False).smallest_bytes
    without, _ = actcore.max_batch(make(), rows, budget, recompute=False, limit=256)
    model = make()
    size, plan = actcore.max_batch(model, rows, budget, limit=256)
    assert size == without >= 32 and plan.recompute == () and plan.kept_bytes <= budget


class _Rotated(nn.Module):
    """A decoder-like block: a tensor in a keyword argument and a pair in a positional one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pair: tuple, *, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x * pair[0] + pair[1]) * scale


def test_tensors_a_recomputed_block_holds_by_reference_are_counted():
    """The checkpoint saves only the top-level positional tensors; the others it keeps by
    reference until backward: the tracker counts them as the profiler does."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Rotated() for _ in range(2))
    for b in blocks:
        set_recompute(b, True)
    inputs: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        # made inside, so that the profiler counts them as the tracker does
        x, cos, sin, scale = (torch.randn(64, 8) for _ in range(4))
        inputs.append(x.requires_grad_())
        h = x
        for b in blocks:
            h = b(h, (cos, sin), scale=scale)
        return h

    with track(blocks) as report:
        out = forward()
    _, profiled = profiled_bytes(forward)
    assert report.retained_bytes == profiled - out.numel() * out.element_size()
    assert report.retained_bytes >= 5 * 64 * 8 * 4  # cos, sin, scale, both blocks' inputs
    out.sum().backward()  # and the recompute still runs
    assert inputs[0].grad is not None
