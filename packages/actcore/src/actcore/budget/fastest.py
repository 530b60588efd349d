"""The plan of least cost within a budget (``order="time"``): each Q-layer's level, each
block's recompute and, per block and for the rest of the model, whether the model scope
compresses what no Q-layer saves, chosen together by a knapsack (:mod:`.knapsack`) over
measured costs.

What each choice keeps is read from per-module tables, each measured with the rest exact
(every Q-layer at each level; every block recomputed, its Q-layers exact, its input
exact and then packed by the scope; the scope on everywhere); what it costs is the step
time it adds (:mod:`.costs`) plus ``error_weight`` times the exact step's seconds per
unit of relative squared gradient error it adds (:mod:`.errors`): with the default weight
of 1, an error of 1% of the gradient's squared norm costs as much as 1% more step time.
Bytes are not quite additive across modules, so the solution is measured; where it keeps
more than the budget, it is solved again for a budget lowered by the excess (a few times
at most), as the peak bound does, and if that does not settle, the largest target whose
solution fits is bisected for (a dozen more forwards at most); where it keeps more than 1%
under the budget, it is solved again for a target raised by the slack, kept while it fits
and costs less.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..memory import format_bytes
from .checkpointing import inside
from .costs import StepTimes
from .knapsack import Block, Option, solve
from .plan import MemoryPlan

__all__ = [
    "RECOMPUTE",
    "RECOMPUTE_PACKED",
    "SCOPE_EXACT",
    "SCOPE_ON",
    "Problem",
    "fastest_plan",
    "scope_bytes",
    "shared_inputs",
]

RECOMPUTE, RECOMPUTE_PACKED = "recompute", "recompute, input packed"
"""The choices of a block recomputed in backward: its input kept exact, or packed by the
model scope (the block's scope on)."""
SCOPE_ON, SCOPE_EXACT = "scope on", "scope exact"
"""The choices of a scope unit: the model scope compresses what it saves, or keeps it."""

_TRIES = 6

Kept = Callable[[Mapping[str, str]], tuple[int, dict[str, int]]]


@dataclass
class Problem:
    """What :func:`fastest_plan` reads. ``kept`` measures a configuration of Q-layer levels
    with the blocks in ``chosen`` recomputed and the model scope compressing in the units of
    ``scoped`` (exact in the others); ``chosen`` and ``scoped`` are left at the plan's."""

    kept: Kept
    chosen: list[str]
    scoped: list[str]
    layers: list[str]  # the Q-layers planned
    names: list[str]  # candidate levels, finest first
    regions: list[str]  # the blocks the plan is made of
    recomputable: list[str]  # those of them that may be recomputed
    units: list[str]  # where the scope can compress or keep exact ("" the rest); [] no scope
    times: StepTimes
    errors: list[dict[str, float]] | None  # per level: Q-layer -> squared gradient error
    unit_errors: dict[str, float] | None  # scope unit -> squared gradient error when on
    norm: float  # the exact gradient's squared norm
    error_weight: float
    tied: Sequence[Sequence[str]] = ()  # Q-layers that take one level (shared_inputs)
    packed_errors: dict[str, float] | None = None  # block -> squared gradient error when
    # recomputed with its scope on (its input packed)


def fastest_plan(problem: Problem, budget: int) -> MemoryPlan:
    """The least-cost plan whose forward keeps at most ``budget`` bytes, measured.
    ValueError naming the smallest budget when none fits."""
    p = problem
    names, layers, regions, units = p.names, p.layers, p.regions, p.units
    groups = _groups(layers, regions, p.tied)
    exact_levels = dict.fromkeys(layers, names[0])

    def measured(
        levels: Mapping[str, str], recomputed: Sequence[str] = (), on: Sequence[str] = ()
    ) -> tuple[int, dict[str, int]]:
        p.chosen[:], p.scoped[:] = recomputed, on
        return p.kept(levels)

    tables = [measured(dict.fromkeys(layers, name))[1] for name in names]
    exact_bytes = measured(exact_levels)[0]
    every = measured(exact_levels, p.recomputable)[1] if p.recomputable else {}
    packable = [b for b in p.recomputable if b in units]  # recomputed, its input packed
    packed = measured(exact_levels, p.recomputable, packable)[1] if packable else {}
    scope_on = measured(exact_levels, (), units)[1] if units else {}
    errors = p.errors
    price = p.error_weight * p.times.exact / p.norm if p.norm > 0 else 0.0
    held = scope_bytes(tables[0], layers, regions)  # the scope's saves, per unit: exact
    held_on = scope_bytes(scope_on, layers, regions)  # ... and compressed

    def options(group: Sequence[str]) -> list[Option]:
        return [
            Option(
                sum(table.get(n, 0) for n in group),
                sum(p.times.layer[i].get(n, 0.0) for n in group)
                + (price * sum(errors[i].get(n, 0.0) for n in group) if errors else 0.0),
                name,
            )
            for i, (name, table) in enumerate(zip(names, tables, strict=True))
        ]

    def scope_choice(unit: str) -> list[Option]:
        exact = Option(held[unit], 0.0, SCOPE_EXACT)
        if unit not in units:
            return [exact]
        error = price * (p.unit_errors or {}).get(unit, 0.0)
        return [exact, Option(held_on[unit], p.times.scope.get(unit, 0.0) + error, SCOPE_ON)]

    def under(table: Mapping[str, int], region: str) -> int:
        return sum(v for k, v in table.items() if inside(k, [region]))

    parts: list[tuple[str | None, list[list[str]], Block]] = []
    for b in regions:
        members = [g for g in groups if inside(g[0], [b])]
        rows = [options(g) for g in members] + [scope_choice(b)]
        wholes = []
        if b in p.recomputable:
            wholes.append(Option(under(every, b), p.times.block.get(b, 0.0), RECOMPUTE))
        if b in packable and b in p.times.packed:
            error = price * (p.packed_errors or {}).get(b, 0.0)
            wholes.append(Option(under(packed, b), p.times.packed[b] + error, RECOMPUTE_PACKED))
        parts.append((b, members, Block(rows, wholes)))
    for g in groups:
        if not inside(g[0], regions):
            parts.append((None, [g], Block([options(g)])))
    parts.append(("", [], Block([scope_choice("")])))

    def configuration(picks: Sequence[object]) -> tuple[dict[str, str], list[str], list[str]]:
        levels: dict[str, str] = {}
        recomputed: list[str] = []
        on: list[str] = []
        for (region, members, _), picked in zip(parts, picks, strict=True):
            if isinstance(picked, Option):  # the block recomputed: its Q-layers exact
                recomputed.append(region)  # type: ignore[arg-type]
                levels.update({n: names[0] for group in members for n in group})
                if picked.choice == RECOMPUTE_PACKED:  # and its scope on: the input packed
                    on.append(region)  # type: ignore[arg-type]
                continue
            for group, option in zip(members, picked, strict=False):  # type: ignore[call-overload]
                levels.update(dict.fromkeys(group, option.choice))
            if region is not None and picked[-1].choice == SCOPE_ON:  # type: ignore[index]
                on.append(region)
        return {n: levels[n] for n in layers}, recomputed, [u for u in units if u in on]

    # the least a plan keeps: the lightest by the tables, every Q-layer at the coarsest level
    # with the scope on everywhere (layers and scope that pack alike share packings, which
    # the tables, each measured with the others exact, do not see), or every block
    # recomputed with the scope on everywhere (the blocks' inputs packed, the rest's scope
    # on with its Q-layers coarsest)
    lightest = solve([_by_bytes(block) for _, _, block in parts], 2**62)  # cost = bytes
    assert lightest is not None
    candidates = [configuration(lightest.chosen)]
    candidates.append((dict.fromkeys(layers, names[-1]), [], list(units)))
    if p.recomputable:  # every block recomputed, its input packed by the scope around it
        outer = {n: names[0] if inside(n, p.recomputable) else names[-1] for n in layers}
        candidates.append((outer, list(p.recomputable), list(units)))
    sizes = [measured(*c)[0] for c in candidates]
    smallest = min(sizes)
    least = candidates[sizes.index(smallest)]

    def planned_as(
        config: tuple[dict[str, str], list[str], list[str]], used: int, **extra: Any
    ) -> MemoryPlan:
        levels, recomputed, on = config
        index = {name: i for i, name in enumerate(names)}
        p.chosen[:], p.scoped[:] = recomputed, on
        return MemoryPlan(
            budget,
            levels,
            used,
            exact_bytes,
            min(smallest, used),  # a solution can measure lighter than the candidates
            recompute=tuple(recomputed),
            scope={u: u in on for u in units},
            step_seconds=p.times.predict({n: index[v] for n, v in levels.items()}, recomputed, on),
            exact_seconds=p.times.exact,
            **extra,
        )

    blocks_only = [block for _, _, block in parts]

    def attempt(target: int) -> tuple[Any, int, int, float] | None:
        """(configuration, bytes measured, bytes predicted, cost) of the solution for
        ``target``."""
        solution = solve(blocks_only, target) if target >= 0 else None
        if solution is None:
            return None
        config = configuration(solution.chosen)
        return config, measured(*config)[0], solution.bytes, solution.cost

    def raised(found: tuple[Any, int, int, float], target: int) -> tuple[Any, int, int, float]:
        """Where a fitting solution keeps more than 1% under the budget (the tables count
        twice what Q-layers and the scope pack once), a solution for the target raised by
        that slack, while it still fits and costs less."""
        for _ in range(_TRIES):
            slack = budget - found[1]
            if slack <= budget // 100:
                break
            again = attempt(target + slack)
            if again is None or again[1] > budget or again[3] >= found[3]:
                break
            found, target = again, target + slack
        return found

    target, failed = budget, budget + 1
    for _ in range(_TRIES):  # lower the target by what the last solution kept too much
        found = attempt(target)
        if found is None:
            break
        if found[1] <= budget:
            config, used, predicted, _ = raised(found, target)
            return planned_as(config, used, predicted_bytes=predicted)
        failed = target
        target = min(target - 1, target - (found[1] - budget))
    # the excess did not settle: bisect the target between nothing and the last that failed
    # (a solution's cost never falls as the target does: the largest that fits is cheapest)
    best, low, high = None, -1, failed
    while high - low > max(1, budget // 1024):
        mid = (low + high) // 2
        found = attempt(mid)
        if found is not None and found[1] > budget:
            high = mid
            continue
        low = mid
        if found is not None:
            best = found
    if best is not None:
        config, used, predicted, _ = best
        return planned_as(config, used, predicted_bytes=predicted)
    if smallest <= budget:  # the lightest configuration fits where the solutions did not
        return planned_as(least, smallest)
    how = f"{len(least[1])} of {len(p.recomputable)} blocks recomputed, the other Q-layers " + (
        f"at their lightest of {', '.join(names)}"
    )
    if units:
        how += f", the scope compressing in {len(least[2])} of {len(units)} parts"
    raise ValueError(
        f"a budget of {format_bytes(budget)} cannot be met: the least a plan keeps is "
        f"{format_bytes(smallest)} ({smallest} bytes, {how}), the smallest budget that "
        f"fits; exact ({names[0]}) keeps {format_bytes(exact_bytes)}"
    )


def scope_bytes(
    table: Mapping[str, int], layers: Collection[str], regions: Sequence[str]
) -> dict[str, int]:
    """What the saves no Q-layer of ``layers`` made keep in ``table`` (bytes by module), per
    region and, under ``""``, outside every region: the model scope's part of each unit."""
    out = dict.fromkeys(["", *regions], 0)
    for key, value in table.items():
        if key in layers:
            continue
        homes = [b for b in regions if inside(key, [b])]
        for home in homes or [""]:
            out[home] += value
    return out


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
        [Option(o.bytes, float(o.bytes), o.choice) for o in block.wholes],
    )
