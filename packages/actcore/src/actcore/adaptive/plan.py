"""The plan of adaptive bits: from the per-layer statistics to bits by rank (host values).

The variance model and the problem it poses are :mod:`actcore.adaptive`'s ("Allocation");
these are its steps. :func:`allocation_items` turns the layers' statistics into allocation
units ``(layer, rank, weight, cost)`` (reading them back: the one sync of a replan),
:func:`ranked_plans` hands the units bits with the one allocator
(:mod:`actcore.adaptive.bit_allocation`), normalization layers starting at the budget;
:func:`rank_counts` spreads a layer's bits by rank over a batch, :func:`plan_prior_bits`
gives the bits before any plan, and :func:`plan_variance`, :func:`plan_average_bits` say
what a plan predicts and costs.
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import Any

from .bit_allocation import allocate, variance
from .stats import LayerStats, has_finite

__all__: list[str] = []


def plan_prior_bits(layer: Any, bits: int, budget: float, max_bits: int) -> int:
    """Bits before any plan: the level's, and two more for depthwise-like convolutions.

    A weight of a grouped convolution with a small fan-in (``in_channels / groups *
    kernel`` <= 32: depthwise 3x3 and 5x5) sums the products of few input elements per
    output position, so the rounding noise of its input averages out far less than in
    a dense layer's weight gradient (EfficientNet's depthwise weights: gradient cosine
    0.65 at 2 bits, 0.83 at 4, on one batch). Replans then follow the statistics.
    """
    groups = getattr(layer, "groups", 1)
    if isinstance(groups, int) and groups > 1:
        kernel = math.prod(getattr(layer, "kernel_size", (1,)))
        if getattr(layer, "in_channels", 0) // groups * kernel <= 32:
            return min(max_bits, max(bits, math.ceil(budget) + 2))
    return bits


def rank_counts(plan: list[int], n: int, bits: int) -> tuple[tuple[int, int], ...]:
    """``(bits, samples)`` for a batch of ``n`` under a layer's ``plan``, most bits first.

    Rank ``r`` of the batch takes ``plan[r * len(plan) // n]``; the plan gives bits by rank,
    non-increasing, so each run ``[s, e)`` of equal bits is taken by the ranks from
    ``ceil(s n / len)`` to ``ceil(e n / len)``: one bisection per run, not a pass per rank
    (a graph's batch is its nodes, thousands of them).
    """
    if not plan:
        return ((bits, n),)
    size = len(plan)
    counts = []
    start = 0
    while start < size:
        value = plan[start]
        end = bisect.bisect_right(plan, -value, lo=start, key=operator.neg)  # first smaller
        taken = -(-end * n // size) - -(-start * n // size)
        if taken:
            counts.append((value, taken))
        start = end
    return tuple(counts)


def allocation_items(
    layers: dict[str, LayerStats], steps: int, window: int
) -> list[tuple[str, int, float, float]]:
    """``(layer, rank, weight, cost)`` of every allocation unit (host values)."""
    # A layer reusing another's stored input (k/v beside q, up beside gate) has no
    # profile of its own; the stored error reaches its weight gradient too, so its
    # sensitivity adds to the owner's.
    shared: dict[str, float] = {}
    for st in layers.values():
        if st.shares is not None and st.profile is None and has_finite(st.sens, st.sens_seen):
            shared[st.shares] = shared.get(st.shares, 0.0) + float(st.sens)
    items = []
    for name, st in layers.items():
        if st.sens is None or st.profile is None or st.elems is None or st.pinned:
            continue  # (a hidden state several linears read keeps row-norm bits)
        if st.last_step is not None and st.last_step < steps - window:
            continue  # packs nothing any more (a head that now keeps the loss's tensor)
        if any(seen is not None and int(seen) == 0 for seen in (st.sens_seen, st.profile_seen)):
            continue  # no finite value yet
        sens, elems = float(st.sens) + shared.get(name, 0.0), float(st.elems)
        profile = st.profile.double().cpu().tolist()
        if not all(math.isfinite(v) for v in (sens, elems, *profile)):
            continue
        if st.zero_value:  # one width for the whole tensor
            items.append((name, -1, sens * sum(profile) / 4, elems * len(profile)))
        else:
            items += [(name, r, sens * w / 4, elems) for r, w in enumerate(profile)]
    return items


def ranked_plans(
    layers: dict[str, LayerStats],
    items: list[tuple[str, int, float, float]],
    budget: float,
    min_bits: int,
    max_bits: int,
) -> dict[str, list[int]]:
    """Bits by rank, largest first, of every layer among ``items`` (a plan)."""
    if not items:
        return {}
    # Normalization layers never go below the budget: an error in their (normalized)
    # input enters the *input* gradient, which every earlier layer receives, where the
    # variance model only counts the layer's own weight gradient (at 1 bit their
    # inputs stalled a fine-tuned MiniLM; see the module docstring).
    floor = min(max_bits, max(min_bits, math.ceil(budget)))
    start = [floor if layers[name].norm else min_bits for name, *_ in items]
    weights = [w for _, _, w, _ in items]
    costs = [c for *_, c in items]
    bits = allocate(weights, costs, start, max_bits, budget=budget).bits
    plans: dict[str, list[tuple[int, int]]] = {}
    for (name, rank, _, _), b in zip(items, bits, strict=True):
        plans.setdefault(name, []).append((rank, b))
    # equal weights can leave ties out of order: bits sorted, largest first, by rank
    return {name: sorted((b for _, b in ranked), reverse=True) for name, ranked in plans.items()}


def plan_variance(
    layers: dict[str, LayerStats],
    items: list[tuple[str, int, float, float]],
    plan: dict[str, list[int]] | None,
) -> float:
    """``sum V_li(b_li)`` for ``plan`` (layer -> bits by rank; None: the layers' own plans)."""
    total = 0.0
    for name, rank, weight, _ in items:
        bits_by_rank = (plan or {}).get(name) or layers[name].plan
        if not bits_by_rank:
            raise ValueError(f"no plan for layer {name!r}")
        total += variance(weight, bits_by_rank[max(rank, 0)])
    return total


def plan_average_bits(
    layers: dict[str, LayerStats], items: list[tuple[str, int, float, float]]
) -> float:
    """Cost-weighted average bits of the layers' plans."""
    num = den = 0.0
    for name, rank, _, cost in items:
        plan = layers[name].plan
        if plan:
            num += cost * plan[max(rank, 0)]
            den += cost
    return num / den if den else math.nan
