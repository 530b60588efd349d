"""The choice a memory plan solves: one option per planned unit, the least total cost whose
bytes fit a capacity (a multiple-choice knapsack, with blocks that can be replaced whole).

A :class:`Block` is a list of members, each a list of :class:`Option` (one is chosen per
member: a Q-layer's level), and ``wholes``, options of which one may replace all of them
(the block recomputed in backward, its members' own saves then recomputed, not kept; its
input kept exact or packed). A Q-layer outside every block is a block of one member.
:func:`solve` is a dynamic program over bytes counted in units of ``capacity /
resolution`` (each option's bytes rounded to the nearest unit; with a unit of one byte it
is exact): per block, the cheapest cost of each total of its members, cut to the points no
lighter total beats; then those fronts combined block by block. Among the cheapest
solutions it returns the lightest, so a smaller capacity never gets a heavier solution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Block", "Option", "Solution", "solve"]

RESOLUTION = 4096
"""Units of bytes the capacity is counted in (at most; one byte when it is smaller)."""


@dataclass(frozen=True)
class Option:
    """One choice for a member or a block: the bytes it keeps, its cost, and what it is."""

    bytes: int
    cost: float
    choice: Any = None


@dataclass(frozen=True)
class Block:
    """Members (a list of options each, one chosen per member), or one of ``wholes``
    instead."""

    members: Sequence[Sequence[Option]]
    wholes: Sequence[Option] = ()


@dataclass(frozen=True)
class Solution:
    """The option chosen per block: one of its ``wholes`` where that was taken, else one
    option per member; and the totals of the chosen options' bytes and costs."""

    chosen: list[Option | list[Option]]
    bytes: int
    cost: float


def solve(blocks: Sequence[Block], capacity: int, resolution: int = RESOLUTION) -> Solution | None:
    """The least-cost choice whose bytes (counted in units, see the module docstring) fit
    ``capacity``, the lightest among equals; None when even the lightest does not fit.
    ``chosen[i]`` is one of block ``i``'s ``wholes``, or the list of its members' options."""
    if capacity < 0:
        return None
    unit = max(1, math.ceil(capacity / resolution))
    top = capacity // unit
    inf = math.inf

    def units(n: int) -> int:
        return int((n + unit // 2) // unit)

    total = np.full(top + 1, inf)
    total[0] = 0.0
    steps: list[tuple[np.ndarray, list[tuple[int, Any]]]] = []
    for block in blocks:
        front = _front(block, top, units)  # (weight, cost, how) per point, weight ascending
        combined = np.full(top + 1, inf)
        pick = np.full(top + 1, -1, dtype=np.int32)
        for i, (w, cost, _) in enumerate(front):
            if w > top:
                break
            _relax(combined, pick, total, w, cost, i)
        steps.append((pick, [(w, how) for w, _, how in front]))
        total = combined
    if not np.isfinite(total).any():
        return None
    at = int(np.argmin(total))  # the first of the cheapest: the lightest
    cost = float(total[at])
    chosen: list[Any] = []
    for pick, front in reversed(steps):
        w, how = front[int(pick[at])]
        chosen.append(how)
        at -= w
    chosen.reverse()
    used = sum(o.bytes if isinstance(o, Option) else sum(m.bytes for m in o) for o in chosen)
    return Solution(chosen, used, cost)


def _relax(
    into: np.ndarray, pick: np.ndarray, base: np.ndarray, w: int, cost: float, index: int
) -> None:
    """One option of ``w`` units and ``cost`` added to every total of ``base``: where that
    beats ``into`` (``into[c] > base[c - w] + cost``), take it and note ``index`` in ``pick``."""
    candidate = base[: len(base) - w] + cost
    better = candidate < into[w:]
    into[w:][better] = candidate[better]
    pick[w:][better] = index


def _front(block: Block, top: int, units: Any) -> list[tuple[int, float, Any]]:
    """The block's points (weight in units, cost, how: a whole option or the members'
    options) that no lighter point matches in cost, lightest first."""
    inf = math.inf
    best = np.full(top + 1, inf)
    best[0] = 0.0
    picks: list[np.ndarray] = []
    for options in block.members:
        nxt = np.full(top + 1, inf)
        pick = np.full(top + 1, -1, dtype=np.int32)
        for i, option in enumerate(options):
            w = units(option.bytes)
            if w <= top:
                _relax(nxt, pick, best, w, option.cost, i)
        picks.append(pick)
        best = nxt
    points: list[tuple[int, float, Any]] = []
    lowest = inf
    candidates = sorted(
        [(int(w), float(best[w]), None) for w in np.flatnonzero(np.isfinite(best))]
        + [(units(o.bytes), o.cost, o) for o in block.wholes if units(o.bytes) <= top],
        key=lambda p: (p[0], p[1]),
    )
    for w, cost, whole in candidates:
        if cost >= lowest:
            continue
        lowest = cost
        points.append(
            (w, cost, whole if whole is not None else _members_at(block, picks, w, units))
        )
    return points


def _members_at(block: Block, picks: list[np.ndarray], w: int, units: Any) -> list[Option]:
    chosen = []
    for options, pick in zip(reversed(block.members), reversed(picks), strict=True):
        option = options[int(pick[w])]
        chosen.append(option)
        w -= units(option.bytes)
    chosen.reverse()
    return chosen
