"""The memory plan's knapsack: exact against brute force on small instances, the lightest of
the cheapest, never heavier as the capacity falls, and fast on a 32-block model."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from actcore.budget.knapsack import Block, Option, solve


def _random_blocks(rng: random.Random, n_blocks: int) -> list[Block]:
    blocks = []
    for b in range(n_blocks):
        members = []
        for m in range(rng.randint(1, 3)):
            exact = rng.randint(20, 200)
            options = [Option(exact, 0.0, (b, m, 0))]
            for level in range(1, 4):
                options.append(Option(exact // (2 * level), rng.uniform(0.1, 3.0), (b, m, level)))
            members.append(options)
        # none, one (recompute) or two (recompute, its input packed: lighter, costlier) wholes
        wholes = [
            Option(rng.randint(10, 150), rng.uniform(0.5, 5.0), (b, "whole", k))
            for k in range(rng.choice((0, 1, 1, 2)))
        ]
        blocks.append(Block(members, wholes))
    return blocks


def _brute_force(blocks: list[Block], capacity: int) -> tuple[float, int] | None:
    per_block = []
    for block in blocks:
        ways = [list(c) for c in itertools.product(*block.members)]
        ways += [[whole] for whole in block.wholes]
        per_block.append(ways)
    best = None
    for combo in itertools.product(*per_block):
        options = [o for way in combo for o in way]
        used = sum(o.bytes for o in options)
        cost = sum(o.cost for o in options)
        if used <= capacity and (best is None or (cost, used) < best):
            best = (cost, used)
    return best


def _options(solution) -> list[Option]:
    return [o for c in solution.chosen for o in (c if isinstance(c, list) else [c])]


@pytest.mark.parametrize("seed", range(12))
def test_it_is_exact_against_brute_force_on_small_instances(seed):
    rng = random.Random(seed)
    blocks = _random_blocks(rng, 3)
    lightest = sum(
        min([sum(min(o.bytes for o in m) for m in b.members)] + [w.bytes for w in b.wholes])
        for b in blocks
    )
    heaviest = sum(sum(max(o.bytes for o in m) for m in b.members) for b in blocks)
    for capacity in sorted({lightest - 1, lightest, (lightest + heaviest) // 2, heaviest}):
        want = _brute_force(blocks, capacity)
        got = solve(blocks, capacity)
        if want is None:
            assert got is None
            continue
        assert got is not None
        options = _options(got)
        assert got.bytes == sum(o.bytes for o in options) <= capacity
        assert got.cost == pytest.approx(sum(o.cost for o in options))
        assert got.cost == pytest.approx(want[0], abs=1e-9)
        assert got.bytes == want[1]  # the lightest of the cheapest
        for block, chosen in zip(blocks, got.chosen, strict=True):
            if isinstance(chosen, Option):
                assert any(chosen is whole for whole in block.wholes)
            else:
                assert all(o in m for o, m in zip(chosen, block.members, strict=True))


def test_a_smaller_capacity_never_gets_a_heavier_or_cheaper_solution():
    blocks = _random_blocks(random.Random(7), 6)
    heaviest = sum(sum(max(o.bytes for o in m) for m in b.members) for b in blocks)
    last = None
    for capacity in range(heaviest, 0, -7):
        got = solve(blocks, capacity)
        if got is None:
            break
        if last is not None:
            assert got.bytes <= last.bytes and got.cost >= last.cost - 1e-12
        last = got
    assert last is not None and got is None  # it ran down to where nothing fits


def test_rounding_to_units_keeps_large_instances_within_a_unit_per_option():
    blocks = _random_blocks(random.Random(3), 8)
    scaled = [
        Block(
            [[Option(o.bytes * 10_007, o.cost, o.choice) for o in m] for m in b.members],
            [Option(w.bytes * 10_007, w.cost, w.choice) for w in b.wholes],
        )
        for b in blocks
    ]
    heaviest = sum(sum(max(o.bytes for o in m) for m in b.members) for b in scaled)
    capacity = heaviest // 2
    got = solve(scaled, capacity, resolution=512)
    n_options = len(_options(got))
    unit = -(-capacity // 512)
    assert got.bytes <= capacity + n_options * unit // 2


def test_a_32_block_model_is_solved_in_under_two_seconds():
    rng = random.Random(0)
    blocks = []
    for _ in range(32):  # a decoder layer: 7 linears and 2 norms, 4 levels each, or recomputed
        # (its input exact, or packed)
        members = []
        for _ in range(9):
            exact = rng.randint(1, 64) * 2**20
            members.append(
                [
                    Option(exact >> (k + 1) if k else exact, k * rng.uniform(0.5, 1.5))
                    for k in range(4)
                ]
            )
        wholes = [Option(8 * 2**20, rng.uniform(5, 10)), Option(2**20, rng.uniform(10, 12))]
        blocks.append(Block(members, wholes))
    heaviest = sum(sum(m[0].bytes for m in b.members) for b in blocks)
    start = time.perf_counter()
    got = solve(blocks, heaviest // 5)
    elapsed = time.perf_counter() - start
    assert got is not None and got.bytes <= heaviest // 5 * 1.01
    assert elapsed < 2.0, elapsed


def test_nothing_fits_a_negative_or_too_small_capacity():
    blocks = [Block([[Option(10, 0.0), Option(5, 1.0)]])]
    assert solve(blocks, -1) is None
    assert solve(blocks, 4) is None
    assert solve(blocks, 5).bytes == 5
    assert solve([], 0).bytes == 0
