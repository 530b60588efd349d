"""Weighted L2-optimal piecewise-constant approximation of a function of one variable.

Given a function ``g`` (an activation's derivative) and a probability density ``p``, find
borders ``b_1 < ... < b_{K-1}`` and levels ``c_1 .. c_K`` minimising

    E_{x ~ p}[(g(x) - c(x))^2],   c(x) = c_i on the i-th interval.

For fixed borders the best level of an interval is the ``p``-weighted mean of ``g`` on it, and
the error of an interval is its weighted variance. The borders are chosen by exact dynamic
programming over the edges of a fine uniform grid: cell moments ``∫ p g^r dx`` (r = 0, 1, 2)
are integrated per cell by Gauss-Legendre quadrature, the cost of a run of cells follows from
prefix sums, and one pass over ``K = 1 .. max_intervals`` gives the optimum for every ``K``.
The result is optimal among borders on the grid; put the kinks of ``g`` on grid edges.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

__all__ = ["NORMAL", "Distribution", "Fit", "fit_piecewise_constant", "normal", "uniform"]

_QUADRATURE_NODES = 8
_BLOCK = 256  # grid edges per vectorised DP block (bounds the temporary matrices)


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A weight for the L2 error: a probability density ``pdf`` and the interval it is
    integrated over (``lo``, ``hi``). Mass outside the interval is ignored."""

    name: str
    pdf: Callable[[np.ndarray], np.ndarray]
    lo: float
    hi: float

    def folded(self) -> Distribution:
        """The density of ``|x|``: ``p(t) + p(-t)`` on ``[0, max(|lo|, |hi|)]``."""
        pdf = self.pdf
        return Distribution(
            f"|{self.name}|",
            lambda t: pdf(t) + pdf(-t),
            0.0,
            max(abs(self.lo), abs(self.hi)),
        )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo < self.hi):
            raise ValueError(
                f"distribution support must be finite with lo < hi, got [{self.lo}, {self.hi}]"
            )


def normal(mean: float = 0.0, std: float = 1.0, width: float = 8.0) -> Distribution:
    """Normal density, integrated over ``mean ± width * std`` (default 8σ: mass outside
    ~1.2e-15)."""
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")

    def pdf(x: np.ndarray) -> np.ndarray:
        z = (x - mean) / std
        return np.exp(-0.5 * z * z) / (std * math.sqrt(2.0 * math.pi))

    name = f"normal(mean={float(mean)!r}, std={float(std)!r})"
    return Distribution(name, pdf, mean - width * std, mean + width * std)


def uniform(lo: float, hi: float) -> Distribution:
    """Uniform density on ``[lo, hi]``."""
    lo, hi = float(lo), float(hi)
    if not lo < hi:
        raise ValueError(f"uniform needs lo < hi, got [{lo}, {hi}]")
    return Distribution(
        f"uniform(lo={lo!r}, hi={hi!r})", lambda x: np.full_like(x, 1.0 / (hi - lo)), lo, hi
    )


NORMAL = normal()
"""The default weight: the standard normal N(0, 1) (pre-activations after normalisation)."""


@dataclasses.dataclass(frozen=True)
class Fit:
    """The optimal piecewise-constant fit with ``len(levels)`` intervals."""

    borders: tuple[float, ...]
    levels: tuple[float, ...]
    error: float  # E[(g - c)^2] under the (normalised) weight
    variance: float  # E[(g - E g)^2]: the error of the best single constant


def _cell_moments(
    g: Callable[[np.ndarray], np.ndarray], pdf: Callable, edges: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per cell ∫p, ∫p·(g-s), ∫p·(g-s)² by Gauss-Legendre quadrature, with the weight
    normalised to mass 1 and ``s`` (returned last) the weighted mean of ``g``."""
    nodes, weights = np.polynomial.legendre.leggauss(_QUADRATURE_NODES)
    half = 0.5 * np.diff(edges)[:, None]
    mid = 0.5 * (edges[1:] + edges[:-1])[:, None]
    x = mid + half * nodes[None, :]
    w = half * weights[None, :] * pdf(x)
    gx = np.asarray(g(x), dtype=np.float64)
    if not np.all(np.isfinite(gx)):
        raise ValueError("the function to approximate is not finite on the grid")
    m0 = w.sum(axis=1)
    total = m0.sum()
    if not total > 0:
        raise ValueError("the weight has no mass on the grid")
    m0 = m0 / total
    w = w / total
    shift = float((w * gx).sum())  # centring keeps the prefix-sum differences accurate
    gx = gx - shift
    return m0, (w * gx).sum(axis=1), (w * gx * gx).sum(axis=1), shift


def _segment_cost(p0: np.ndarray, p1: np.ndarray, p2: np.ndarray, i: np.ndarray, j: np.ndarray):
    """Weighted variance of g over cells ``i .. j-1`` (broadcast over ``i`` and ``j``)."""
    s0 = p0[j] - p0[i]
    s1 = p1[j] - p1[i]
    s2 = p2[j] - p2[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = s2 - np.where(s0 > 0, s1 * s1 / np.where(s0 > 0, s0, 1.0), 0.0)
    cost = np.maximum(cost, 0.0)
    return np.where(i < j, cost, np.inf)


def fit_piecewise_constant(
    g: Callable[[np.ndarray], np.ndarray],
    distribution: Distribution,
    counts: tuple[int, ...],
    *,
    cells: int,
    lo: float | None = None,
    hi: float | None = None,
) -> dict[int, Fit]:
    """Optimal fits of ``g`` with each number of intervals in ``counts``.

    The grid has ``cells`` equal cells on ``[lo, hi]`` (the distribution's support by
    default); borders are grid edges, and the outer intervals extend to ±infinity.
    """
    lo = distribution.lo if lo is None else float(lo)
    hi = distribution.hi if hi is None else float(hi)
    kmax = max(counts)
    if min(counts) < 1 or kmax > cells:
        raise ValueError(f"interval counts must be in 1..{cells} (the grid cells), got {counts}")
    edges = np.linspace(lo, hi, cells + 1)
    m0, m1, m2, shift = _cell_moments(g, distribution.pdf, edges)
    p0, p1, p2 = (np.concatenate([[0.0], np.cumsum(m)]) for m in (m0, m1, m2))

    n = cells
    idx = np.arange(n + 1)
    cost = np.empty((n + 1, n + 1))  # cost[i, j]: one interval over cells i .. j-1
    for start in range(0, n + 1, _BLOCK):
        j = idx[start : start + _BLOCK]
        cost[:, j] = _segment_cost(p0, p1, p2, idx[:, None], j[None, :])
    best = cost[0].copy()  # best[j]: least error of cells 0 .. j-1 in k intervals
    back = np.zeros((kmax + 1, n + 1), dtype=np.int64)
    for k in range(2, kmax + 1):
        new = np.empty(n + 1)
        for start in range(0, n + 1, _BLOCK):
            j = idx[start : start + _BLOCK]
            total = best[:, None] + cost[:, j]
            arg = np.argmin(total, axis=0)
            new[j] = total[arg, np.arange(j.size)]
            back[k, j] = arg
        best = new

    fits = {}
    variance = float(cost[0, n])
    for k in counts:
        cuts = [n]
        for layer in range(k, 1, -1):
            cuts.append(int(back[layer, cuts[-1]]))
        cuts.append(0)
        cuts.reverse()  # cell indices 0 = c_0 < c_1 < ... < c_k = n
        levels, error = [], 0.0
        for a, b in itertools.pairwise(cuts):
            s0, s1, s2 = m0[a:b].sum(), m1[a:b].sum(), m2[a:b].sum()
            level = s1 / s0 if s0 > 0 else 0.0
            levels.append(level)
            error += s2 - 2.0 * level * s1 + level * level * s0
        fits[k] = Fit(
            borders=tuple(float(edges[c]) for c in cuts[1:-1]),
            levels=tuple(float(v + shift) for v in levels),
            error=max(float(error), 0.0),
            variance=variance,
        )
    return fits
