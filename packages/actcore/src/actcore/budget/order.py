"""The order in which Q-layers go coarser: paths of configurations from all exact to all
coarsest (by bytes saved, or by bytes saved per gradient error), and the refinement that
spends what the path's first fitting step left of the budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

__all__ = ["bytes_path", "error_path", "refine"]


def refine(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    config: dict[str, str],
    used: int,
    by_module: list[dict[str, int]],
    names: list[str],
    budget: int,
    errors: list[dict[str, float]] | None = None,
) -> tuple[dict[str, str], int]:
    """Spend what the path's step left of the budget: layers one level finer again while
    the tables say they fit, the cheapest first (with ``errors``: the most gradient error
    taken off per byte first); then the longest run of those moves that fits when
    measured (a bisection)."""
    rank = {name: i for i, name in enumerate(names)}
    trial, moves, slack = dict(config), [], budget - used
    while True:
        best, best_key, best_cost = None, math.inf, 0
        for layer, level in trial.items():
            i = rank[level]
            if i > 0:
                cost = by_module[i - 1].get(layer, 0) - by_module[i].get(layer, 0)
                if errors is None:
                    key = cost
                elif cost > slack:
                    continue
                else:
                    gain = errors[i].get(layer, 0.0) - errors[i - 1].get(layer, 0.0)
                    key = cost / gain if gain > 0 else math.inf
                if key < best_key:
                    best, best_key, best_cost = layer, key, cost
        if best is None or best_cost > slack:
            break
        trial[best] = names[rank[trial[best]] - 1]
        moves.append((best, trial[best]))
        slack -= best_cost

    def applied(k: int) -> dict[str, str]:
        out = dict(config)
        for layer, level in moves[:k]:
            out[layer] = level
        return out

    lo, hi, best_used = 0, len(moves), used  # moves[:lo] fit (measured)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        now = kept(applied(mid))[0]
        if now <= budget:
            lo, best_used = mid, now
        else:
            hi = mid - 1
    return applied(lo), best_used


def bytes_path(
    layers: list[str], by_module: list[dict[str, int]], names: list[str]
) -> list[dict[str, str]]:
    """Configurations from all ``names[0]`` to all ``names[-1]``, one layer one level coarser
    per step, the move that saves the most bytes (by the uniform tables) first."""
    config = dict.fromkeys(layers, names[0])
    index = dict.fromkeys(layers, 0)
    path = [dict(config)]
    while True:
        best, best_saving = None, -math.inf
        for layer in layers:
            i = index[layer]
            if i + 1 < len(names):
                saving = by_module[i].get(layer, 0) - by_module[i + 1].get(layer, 0)
                if saving > best_saving:
                    best, best_saving = layer, saving
        if best is None:
            return path
        index[best] += 1
        config[best] = names[index[best]]
        path.append(dict(config))


def error_path(
    layers: list[str],
    by_module: list[dict[str, int]],
    names: list[str],
    errors: list[dict[str, float]],
) -> list[dict[str, str]]:
    """Configurations from all ``names[0]`` to all ``names[-1]``: per step, the move of one
    layer to a coarser level (skipping levels that save nothing) that adds the least
    gradient error per byte saved; moves that save nothing come last."""
    config = dict.fromkeys(layers, names[0])
    index = dict.fromkeys(layers, 0)
    path = [dict(config)]
    while True:
        best, best_key, best_to = None, math.inf, 0
        for layer in layers:
            i = index[layer]
            for j in range(i + 1, len(names)):
                saving = by_module[i].get(layer, 0) - by_module[j].get(layer, 0)
                if saving <= 0:
                    continue
                added = max(errors[j].get(layer, 0.0) - errors[i].get(layer, 0.0), 0.0)
                if added / saving < best_key:
                    best, best_key, best_to = layer, added / saving, j
        if best is None:  # what is left saves nothing
            for layer in layers:
                if index[layer] < len(names) - 1:
                    index[layer] = len(names) - 1
                    config[layer] = names[-1]
                    path.append(dict(config))
            return path
        index[best] = best_to
        config[best] = names[best_to]
        path.append(dict(config))
