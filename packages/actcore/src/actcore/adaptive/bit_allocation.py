"""Greedy marginal bit allocation: the one allocator of every adaptive policy.

Item ``i`` (a saved tensor, or one rank of one layer's samples) stored at ``b_i`` bits is
predicted to add variance ``w_i / (2^b_i - 1)^2`` (:func:`variance`) and to cost
``c_i * b_i`` (``c_i``: its elements). The total ``sum_i w_i / (2^b_i - 1)^2`` is separable
and convex in each ``b_i`` (the drop from one more bit shrinks with ``b``), so taking one-bit
increments greedily, largest drop per cost first, is the classic solution. :func:`allocate`
does so from a heap of the items' next increments, from given start bits per item, in one of
two modes:

* **budget** (``AdaptiveBits``, ``AutoPrecision``): the fewest predicted variance with the
  cost-weighted average bits at most ``budget``, i.e. ``sum c_i b_i <= budget * sum c_i``
  (up to ``slack`` for rounding); an increment that no longer fits is passed over, bits stay
  in ``start..max_bits``.
* **error target** (``ACGC``): the dual, increments until the total predicted variance is at
  most ``target``; past ``max_bits`` an item is kept uncompressed (``None``, no variance),
  a step of ``32 - b`` more bits per element.

Equal drops per cost go to the item listed first, so a plan depends only on the items, in
order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Allocation", "allocate", "variance"]

_UNCOMPRESSED = 32  # bits per element of an item kept uncompressed (error-target mode)
_TINY = 1e-12  # the least cost a step is divided by (an item that stores nothing)


def variance(weight: float, bits: int | None) -> float:
    """``weight / (2^bits - 1)^2``: an item's predicted variance (``None``: uncompressed, 0)."""
    return 0.0 if bits is None else weight / float(2**bits - 1) ** 2


@dataclass(frozen=True)
class Allocation:
    """Bits per item, in the items' order, and the predicted variance of that plan.

    ``bits`` holds ``None`` (kept uncompressed) only in error-target mode. ``variance`` is
    ``sum_i w_i / (2^b_i - 1)^2``; in error-target mode, the running total the stopping rule
    compared with the target (equal up to rounding).
    """

    bits: list[int | None]
    variance: float


def allocate(
    weights: Sequence[float],
    costs: Sequence[float],
    start: int | Sequence[int],
    max_bits: int,
    *,
    budget: float | None = None,
    target: float | None = None,
    slack: float = 0.0,
) -> Allocation:
    """Bits per item by greedy marginal allocation (see the module docstring).

    ``weights``, ``costs``: ``w_i`` and ``c_i`` (elements stored per bit), both >= 0.
    ``start``: the bits every item starts at (one int for all, or one per item), each in
    ``1..max_bits``. Exactly one of ``budget`` (average bits, cost-weighted; ``slack``: how
    far rounding may overrun it) or ``target`` (the most total predicted variance).
    """
    if (budget is None) == (target is None):
        raise ValueError("allocate needs exactly one of budget and target")
    n = len(weights)
    if len(costs) != n:
        raise ValueError(f"{n} weights but {len(costs)} costs")
    bits: list[int] = [start] * n if isinstance(start, int) else list(start)
    if len(bits) != n:
        raise ValueError(f"{n} weights but {len(bits)} start bits")
    bad = [b for b in bits if not 1 <= b <= max_bits]
    if bad:
        raise ValueError(f"start bits {bad[:3]} outside 1..max_bits = 1..{max_bits}")
    if budget is not None:
        return _within_budget(weights, costs, bits, max_bits, budget, slack)
    assert target is not None
    return _to_target(weights, costs, bits, max_bits, target)


def _drop(weight: float, bits: int, nxt: int | None) -> float:
    """The fall of an item's predicted variance from ``bits`` to ``nxt``."""
    return variance(weight, bits) - variance(weight, nxt)


def _within_budget(
    weights: Sequence[float],
    costs: Sequence[float],
    bits: list[int],
    max_bits: int,
    budget: float,
    slack: float,
) -> Allocation:
    room = budget * sum(costs) - sum(b * c for b, c in zip(bits, costs, strict=True))
    heap = [
        (-_drop(w, b, b + 1) / max(c, _TINY), i)
        for i, (w, c, b) in enumerate(zip(weights, costs, bits, strict=True))
        if b < max_bits
    ]
    heapq.heapify(heap)
    while heap and room + slack > 0:
        _, i = heapq.heappop(heap)
        cost = costs[i]
        if cost > room + slack:
            continue  # (room only shrinks: it never fits again)
        room -= cost
        b = bits[i] = bits[i] + 1
        if b < max_bits:
            heapq.heappush(heap, (-_drop(weights[i], b, b + 1) / max(cost, _TINY), i))
    total = sum(variance(w, b) for w, b in zip(weights, bits, strict=True))
    return Allocation(list(bits), total)


def _to_target(
    weights: Sequence[float],
    costs: Sequence[float],
    start: list[int],
    max_bits: int,
    target: float,
) -> Allocation:
    bits: list[int | None] = list(start)

    def key(i: int, b: int) -> tuple[float, int]:
        nxt = None if b >= max_bits else b + 1
        cost = costs[i] if nxt is not None else costs[i] * (_UNCOMPRESSED - b)
        return -_drop(weights[i], b, nxt) / max(cost, _TINY), i

    total = sum(variance(w, b) for w, b in zip(weights, bits, strict=True))
    heap = [key(i, b) for i, b in enumerate(start)]
    heapq.heapify(heap)
    while total > target and heap:
        _, i = heapq.heappop(heap)
        b = bits[i]
        assert b is not None
        nxt = None if b >= max_bits else b + 1
        total -= _drop(weights[i], b, nxt)
        bits[i] = nxt
        if nxt is not None:
            heapq.heappush(heap, key(i, nxt))
    return Allocation(bits, total)
