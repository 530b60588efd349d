"""The one bit allocator against a straightforward reference, and its two modes' contracts."""

from __future__ import annotations

import itertools
import random

import pytest

from actcore.adaptive.bit_allocation import allocate, variance


def _next(bits: int, max_bits: int, exact_past_max: bool) -> int | None:
    """The bits one increment takes an item to (None: kept uncompressed)."""
    return bits + 1 if bits < max_bits else (None if exact_past_max else bits)


def _reference(
    weights: list[float],
    costs: list[float],
    start: list[int],
    max_bits: int,
    budget: float | None = None,
    target: float | None = None,
    slack: float = 0.0,
) -> tuple[list[int | None], float]:
    """Greedy by scanning every item each step (no heap): the best drop per cost, first
    listed on ties; budget mode takes only increments that still fit."""
    bits: list[int | None] = list(start)
    spent = sum(b * c for b, c in zip(start, costs, strict=True))
    room = 0.0 if budget is None else budget * sum(costs) - spent
    total = sum(variance(w, b) for w, b in zip(weights, bits, strict=True))

    def more() -> bool:
        return room + slack > 0 if budget is not None else total > target

    while more():
        best, best_gain = None, 0.0
        for i, (w, c, b) in enumerate(zip(weights, costs, bits, strict=True)):
            if b is None or (budget is not None and (b >= max_bits or c > room + slack)):
                continue
            nxt = _next(b, max_bits, budget is None)
            step = c if nxt is not None else c * (32 - b)
            gain = (variance(w, b) - variance(w, nxt)) / max(step, 1e-12)
            if best is None or gain > best_gain:
                best, best_gain = i, gain
        if best is None:
            break
        b = bits[best]
        assert b is not None
        nxt = _next(b, max_bits, budget is None)
        total -= variance(weights[best], b) - variance(weights[best], nxt)
        room -= costs[best]
        bits[best] = nxt
    if budget is not None:  # the plan's variance, summed in item order
        total = sum(variance(w, b) for w, b in zip(weights, bits, strict=True))
    return bits, total


def _instance(rng: random.Random) -> tuple[list[float], list[float], list[int], int, int]:
    n = rng.randint(1, 12)
    if rng.random() < 0.4:  # many exact ties
        weights = [float(rng.randint(0, 3)) for _ in range(n)]
    else:
        weights = [rng.expovariate(1.0) * 10 ** rng.randint(-3, 3) for _ in range(n)]
    costs = [rng.choice([0.0, 1.0, 2.0, 5.0, 64.0, rng.uniform(0.1, 10)]) for _ in range(n)]
    max_bits = rng.randint(1, 8)
    min_bits = rng.randint(1, max_bits)
    start = [rng.randint(min_bits, max_bits) if rng.random() < 0.3 else min_bits for _ in range(n)]
    return weights, costs, start, min_bits, max_bits


@pytest.mark.parametrize("seed", range(4))
def test_budget_mode_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        weights, costs, start, min_bits, max_bits = _instance(rng)
        budget = rng.uniform(min_bits, max_bits)
        slack = rng.choice([0.0, 1e-9])
        got = allocate(weights, costs, start, max_bits, budget=budget, slack=slack)
        expected = _reference(weights, costs, start, max_bits, budget=budget, slack=slack)
        assert (got.bits, got.variance) == expected, (weights, costs, start, max_bits, budget)


@pytest.mark.parametrize("seed", range(4))
def test_error_target_mode_matches_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(300):
        weights, costs, start, _, max_bits = _instance(rng)
        costs = [max(c, 1.0) for c in costs]
        target = sum(weights) * 10 ** rng.uniform(-7, 0)
        got = allocate(weights, costs, start, max_bits, target=target)
        expected = _reference(weights, costs, start, max_bits, target=target)
        assert (got.bits, got.variance) == expected, (weights, costs, start, max_bits, target)


def test_budget_mode_keeps_the_budget_and_is_optimal_on_equal_costs() -> None:
    rng = random.Random(7)
    for _ in range(50):
        weights = [rng.expovariate(1.0) for _ in range(4)]
        budget = rng.uniform(1, 4)
        plan = allocate(weights, [1.0] * 4, 1, 4, budget=budget)
        assert sum(b for b in plan.bits if b is not None) <= budget * 4
        best = min(
            sum(variance(w, b) for w, b in zip(weights, bits, strict=True))
            for bits in itertools.product(range(1, 5), repeat=4)
            if sum(bits) <= budget * 4
        )
        assert plan.variance == pytest.approx(best)


def test_error_target_mode_meets_the_target_and_keeps_tensors_exact_past_max_bits() -> None:
    plan = allocate([1.0, 100.0, 0.0], [10, 10, 10], 2, 4, target=5e-3)
    assert plan.bits == [4, None, 2]  # the heavy item is kept uncompressed, the empty one waits
    assert plan.variance == pytest.approx(variance(1.0, 4)) and plan.variance <= 5e-3
    assert allocate([1.0], [1], 8, 8, target=0.0).bits == [None]


def test_start_bits_per_item_and_ties_in_listed_order() -> None:
    assert allocate([1.0, 1.0, 1.0], [1, 1, 1], [1, 3, 1], 4, budget=2.0).bits == [2, 3, 1]
    assert allocate([0.0] * 3, [1, 1, 1], 1, 8, budget=2.0).bits == [4, 1, 1]  # (no gain)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one of budget and target"):
        allocate([1.0], [1.0], 1, 8)
    with pytest.raises(ValueError, match="exactly one of budget and target"):
        allocate([1.0], [1.0], 1, 8, budget=2.0, target=1.0)
    with pytest.raises(ValueError, match="1 weights but 2 costs"):
        allocate([1.0], [1.0, 2.0], 1, 8, budget=2.0)
    with pytest.raises(ValueError, match="1 weights but 2 start bits"):
        allocate([1.0], [1.0], [1, 2], 8, budget=2.0)
    with pytest.raises(ValueError, match=r"start bits \[9\] outside 1..max_bits = 1..8"):
        allocate([1.0], [1.0], 9, 8, budget=2.0)
