"""The plan of least cost within a budget (``order="time"``): each Q-layer's level and each
block's recompute chosen together by a knapsack (:mod:`.knapsack`) over measured costs.

What each choice keeps is read from the same per-module tables as the other orders (every
Q-layer at each level; every block recomputed, its Q-layers exact); what it costs is the
step time it adds (:mod:`.costs`) plus ``error_weight`` times the exact step's seconds per
unit of relative squared gradient error it adds (:mod:`.errors`): with the default weight
of 1, an error of 1% of the gradient's squared norm costs as much as 1% more step time.
Bytes are not quite additive across modules, so the solution is measured; where it keeps
more than the budget, it is solved again for a budget lowered by the excess (a few times
at most), as the peak bound does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..memory import format_bytes
from .checkpointing import inside
from .costs import StepTimes
from .knapsack import Block, Option, solve
from .plan import MemoryPlan

__all__ = ["RECOMPUTE", "fastest_plan", "shared_inputs"]

RECOMPUTE = "recompute"
"""The choice of a block recomputed in backward."""

_TRIES = 6

Kept = Callable[[Mapping[str, str]], tuple[int, dict[str, int]]]


def fastest_plan(
    kept: Kept,
    chosen: list[str],
    layers: list[str],
    names: list[str],
    blocks: list[str],
    budget: int,
    times: StepTimes,
    errors: list[dict[str, float]] | None,
    norm: float,
    error_weight: float,
    tied: Sequence[Sequence[str]] = (),
) -> MemoryPlan:
    """The least-cost plan whose forward keeps at most ``budget`` bytes, measured (``kept``
    measures a configuration with the blocks in ``chosen`` recomputed; ``chosen`` is left
    at the plan's). ``tied``: groups of Q-layers that take one level together
    (:func:`shared_inputs`). ValueError naming the smallest budget when none fits."""
    groups = _groups(layers, blocks, tied)
    chosen.clear()
    tables = [kept(dict.fromkeys(layers, name))[1] for name in names]
    exact_bytes = kept(dict.fromkeys(layers, names[0]))[0]
    every: dict[str, int] = {}
    if blocks:
        chosen[:] = blocks
        every = kept(dict.fromkeys(layers, names[0]))[1]
        chosen.clear()
    price = error_weight * times.exact / norm if errors is not None and norm > 0 else 0.0
    planned = set(layers)

    def options(group: Sequence[str]) -> list[Option]:
        return [
            Option(
                sum(table.get(n, 0) for n in group),
                sum(times.layer[i].get(n, 0.0) for n in group)
                + (
                    price * sum(errors[i].get(n, 0.0) for n in group) if errors is not None else 0.0
                ),
                name,
            )
            for i, (name, table) in enumerate(zip(names, tables, strict=True))
        ]

    others = {k: v for k, v in tables[0].items() if k not in planned}  # kept whatever the levels
    units: list[tuple[str | None, list[list[str]], Block]] = []
    for b in blocks:
        members = [g for g in groups if inside(g[0], [b])]
        fixed = sum(v for k, v in others.items() if inside(k, [b]))
        whole = Option(
            sum(v for k, v in every.items() if inside(k, [b])), times.block.get(b, 0.0), RECOMPUTE
        )
        rows = [options(g) for g in members] + [[Option(fixed, 0.0)]]
        units.append((b, members, Block(rows, whole)))
    for g in groups:
        if not inside(g[0], blocks):
            units.append((None, [g], Block([options(g)])))
    constant = sum(v for k, v in others.items() if not inside(k, blocks))

    def configuration(solution_chosen: Sequence[object]) -> tuple[dict[str, str], list[str]]:
        levels: dict[str, str] = {}
        recomputed: list[str] = []
        for (block, members, _), picked in zip(units, solution_chosen, strict=True):
            if isinstance(picked, Option):  # the block recomputed: its Q-layers exact
                recomputed.append(block)  # type: ignore[arg-type]
                levels.update({n: names[0] for group in members for n in group})
            else:
                for group, option in zip(members, picked[: len(members)], strict=True):  # type: ignore[index]
                    levels.update(dict.fromkeys(group, option.choice))
        return {n: levels[n] for n in layers}, recomputed

    def measured(levels: Mapping[str, str], recomputed: Sequence[str]) -> int:
        chosen[:] = recomputed
        return kept(levels)[0]

    lightest = solve([_by_bytes(blk) for _, _, blk in units], 2**62)  # cost = bytes
    assert lightest is not None
    smallest_levels, smallest_blocks = configuration(lightest.chosen)
    smallest = measured(smallest_levels, smallest_blocks)
    target = budget - constant
    for _ in range(_TRIES):
        solution = solve([u[2] for u in units], target) if target >= 0 else None
        if solution is None:
            break
        levels, recomputed = configuration(solution.chosen)
        used = measured(levels, recomputed)
        if used <= budget:
            index = {name: i for i, name in enumerate(names)}
            seconds = times.predict({n: index[v] for n, v in levels.items()}, recomputed)
            chosen[:] = recomputed
            return MemoryPlan(
                budget,
                levels,
                used,
                exact_bytes,
                smallest,
                recompute=tuple(recomputed),
                predicted_bytes=constant + solution.bytes,
                step_seconds=seconds,
                exact_seconds=times.exact,
            )
        target = min(target - 1, target - (used - budget))
    chosen.clear()
    if smallest <= budget:  # the lightest configuration fits where the solutions did not
        index = {name: i for i, name in enumerate(names)}
        chosen[:] = smallest_blocks
        return MemoryPlan(
            budget,
            smallest_levels,
            smallest,
            exact_bytes,
            smallest,
            recompute=tuple(smallest_blocks),
            step_seconds=times.predict(
                {n: index[v] for n, v in smallest_levels.items()}, smallest_blocks
            ),
            exact_seconds=times.exact,
        )
    how = f"{len(smallest_blocks)} of {len(blocks)} blocks recomputed, the other Q-layers " + (
        f"at their lightest of {', '.join(names)}"
    )
    raise ValueError(
        f"a budget of {format_bytes(budget)} cannot be met: the least a plan keeps is "
        f"{format_bytes(smallest)} ({smallest} bytes, {how}), the smallest budget that "
        f"fits; exact ({names[0]}) keeps {format_bytes(exact_bytes)}"
    )


def shared_inputs(
    model: nn.Module, layers: Mapping[str, nn.Module], forward: Callable[[nn.Module], Any]
) -> list[list[str]]:
    """Groups of Q-layers that one forward feeds the same input tensor (a block's first
    conv and its downsampling conv; a decoder layer's q, k and v projections). Such layers
    pack that tensor once when they pack it alike, and twice otherwise, so a plan gives
    them one level."""
    seen: dict[tuple, list[str]] = {}
    held: list[torch.Tensor] = []  # alive to the end, so no other tensor takes their memory

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None and x.layout == torch.strided:
                key = (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x._version)
                seen.setdefault(key, []).append(name)
                held.append(x)

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            forward(model)
    finally:
        for h in handles:
            h.remove()
        held.clear()
    return [list(dict.fromkeys(g)) for g in seen.values() if len(set(g)) > 1]


def _groups(
    layers: Sequence[str], blocks: Sequence[str], tied: Sequence[Sequence[str]]
) -> list[list[str]]:
    """The Q-layers as groups that take one level: ``tied``'s groups, split where they span
    blocks (a recomputed block's layers are exact whatever the others), the rest alone."""

    def home(name: str) -> str | None:
        return next((b for b in blocks if inside(name, [b])), None)

    placed: dict[str, list[str]] = {}
    for group in tied:
        by_home: dict[str | None, list[str]] = {}
        for name in group:
            if name in layers and name not in placed:
                by_home.setdefault(home(name), []).append(name)
        for part in by_home.values():
            for name in part:
                placed[name] = part
    out, done = [], set()
    for name in layers:
        group = placed.get(name, [name])
        if group[0] not in done:
            done.add(group[0])
            out.append(group)
    return out


def _by_bytes(block: Block) -> Block:
    """``block`` with each option's cost its bytes: its cheapest is its lightest."""
    return Block(
        [[Option(o.bytes, float(o.bytes), o.choice) for o in row] for row in block.members],
        None
        if block.whole is None
        else Option(block.whole.bytes, float(block.whole.bytes), RECOMPUTE),
    )
