"""Sensitivity-estimated policies: :class:`AutoPrecision` (GACT) and :class:`ACGC` (AC-GC).

Model of the gradient noise (linearised, as GACT and AC-GC analyse it): quantizing saved tensor
``l`` at ``b`` bits with stochastic rounding adds independent zero-mean noise whose variance is
``Q_l(b) = R_l / (2^b - 1)^2`` with ``R_l = sum_groups n_g * range_g^2 / 6`` (closed form from
the per-group ranges, read off the quantizer's own metadata), and it moves the parameter
gradient by ``E||dg||^2 = sum_l c_l * Q_l(b_l)``. The sensitivities ``c_l`` are measured every
``adapt_interval`` iterations by :meth:`AdaptivePolicy.adapt`: one baseline pass and at most
``max_passes`` probe passes (tensors are split into that many groups, each group re-drawn with a
fresh rounding seed in one pass, so ``||g_probe - g_base||^2`` estimates ``2 * sum_G c_l Q_l``).
Dropout and other RNG use are replayed identically in every pass. The amortised cost is at most
``(1 + max_passes) / adapt_interval`` iterations per iteration.

An estimate whose gradients or spreads are not finite (an overflowing fp16 step, a bad batch)
is dropped whole: sensitivities and plan stay as they were, the drop is counted
(``skipped``) and logged once. ``load_state_dict`` checks a whole state before changing
anything.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..adaptive.bit_allocation import allocate
from ..ops.api import check_bits
from ..saved_tensors.pass_stats import PassStats
from .base import Policy

__all__ = ["ACGC", "AdaptivePolicy", "AutoPrecision"]

log = logging.getLogger("actcore")


def _seed(key: str, salt: int) -> int:
    digest = hashlib.blake2b(f"{salt}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class _Seeds:
    """Rounding seeds by key: ``probe`` keys get a second salt."""

    def __init__(self, salt: int, probe: frozenset[str] = frozenset()) -> None:
        self.salt, self.probe = salt, probe

    def get(self, key: str, default: int = 0) -> int:
        return _seed(key, self.salt + 1 if key in self.probe else self.salt)


def _rng_state() -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class AdaptivePolicy(Policy):
    """Shared machinery: sensitivity estimation and greedy bit allocation."""

    name = "adaptive"

    def __init__(
        self,
        *,
        adapt_interval: int = 500,
        min_bits: int = 1,
        max_bits: int = 8,
        max_passes: int = 16,
        probe_bits: int = 4,
        swap: bool = False,
    ) -> None:
        if isinstance(adapt_interval, bool) or not isinstance(adapt_interval, int):
            raise TypeError(f"adapt_interval must be an int, got {adapt_interval!r}")
        if adapt_interval < 1:
            raise ValueError(f"adapt_interval must be >= 1, got {adapt_interval}")
        if isinstance(max_passes, bool) or not isinstance(max_passes, int) or max_passes < 1:
            raise ValueError(f"max_passes must be an int >= 1, got {max_passes!r}")
        self.min_bits = check_bits(min_bits, "min_bits")
        self.max_bits = check_bits(max_bits, "max_bits")
        if self.min_bits > self.max_bits:
            raise ValueError(f"min_bits ({min_bits}) must not exceed max_bits ({max_bits})")
        self.probe_bits = check_bits(probe_bits, "probe_bits")
        self.adapt_interval = adapt_interval
        self.max_passes = max_passes
        self.swap = bool(swap)
        self.plan: dict[str, int | None] = {}
        self.sensitivity: dict[str, float] = {}
        self.spread: dict[str, float] = {}  # R_l at the last estimate
        self.numel: dict[str, int] = {}
        self.grad_sq = 0.0  # ||g||^2 at the last estimate
        self.estimates = 0
        self.predicted_error = float("nan")  # predicted relative gradient error of the plan
        self.skipped = 0  # estimates dropped for non-finite gradients or spreads
        self._probing = False

    # ---- decisions --------------------------------------------------------------------------

    def default_bits(self) -> int | None:
        raise NotImplementedError

    def bits_for(self, key: str) -> int | None:
        if self._probing:
            return self.probe_bits
        return self.plan.get(key, self.default_bits()) if self.plan else self.default_bits()

    def average_bits(self) -> float:
        """Element-weighted average bits of the plan (an uncompressed tensor counts 32)."""
        total = sum(self.numel.get(k, 0) for k in self.plan)
        if not total:
            return float("nan")
        return sum(
            (32 if b is None else b) * self.numel.get(k, 0) for k, b in self.plan.items()
        ) / (total)

    # ---- estimation -------------------------------------------------------------------------

    def adapt(self, packer: Any, backprop: Callable[[], Any]) -> None:
        model: nn.Module | None = packer.model
        if model is None:
            raise RuntimeError(f"the {self.name!r} policy needs a model to adapt (use Controller)")
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [None if p.grad is None else p.grad.clone() for p in params]
        rng = _rng_state()
        salt = 2 * self.estimates + 1

        def run(seeds: _Seeds) -> tuple[list[torch.Tensor], Any]:
            for p in params:
                p.grad = None
            packer.seeds, packer.stats = seeds, PassStats()
            _set_rng_state(rng)
            try:
                backprop()
            finally:
                stats, packer.stats, packer.seeds = packer.stats, None, None
            return [p.grad.detach() for p in params if p.grad is not None], stats

        self._probing = True
        try:
            g0, base = run(_Seeds(salt))
            keys = list(base.bits)
            spreads = base.spreads()
            groups = _split(keys, self.max_passes)
            diffs = []
            for group in groups:
                g, _ = run(_Seeds(salt, frozenset(group)))
                diffs.append(_squared_distance(g, g0))
            diff_values = torch.stack(diffs).tolist() if diffs else []
            grad_sq = float(_squared_distance(g0, None))
        finally:
            self._probing = False
            for p, g in zip(params, saved, strict=True):
                p.grad = g
            _set_rng_state(rng)
        if not all(math.isfinite(v) for v in (grad_sq, *diff_values, *spreads.values())):
            self._skip()
            return
        for group, d in zip(groups, diff_values, strict=True):
            var = sum(spreads[k] / (2 ** base.bits[k] - 1) ** 2 for k in group)
            c = d / (2.0 * var) if var > 0 else 0.0
            for k in group:
                old = self.sensitivity.get(k)
                self.sensitivity[k] = c if old is None else 0.5 * (old + c)
        self.spread.update(spreads)
        self.numel.update(base.numel)
        self.grad_sq = grad_sq
        self.estimates += 1
        self._allocate(keys)

    def _skip(self) -> None:
        self.skipped += 1
        if self.skipped == 1:
            log.warning(
                "actcore %s policy: a sensitivity estimate met non-finite gradients (an "
                "overflowing fp16 step or a bad batch) and was dropped; the plan stays as it "
                "was (logged once, counted in .skipped)",
                self.name,
            )

    def _weights(self, keys: list[str]) -> dict[str, float]:
        return {k: max(self.sensitivity.get(k, 0.0), 0.0) * self.spread.get(k, 0.0) for k in keys}

    def _allocate(self, keys: list[str]) -> None:
        raise NotImplementedError

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "plan": dict(self.plan),
            "sensitivity": dict(self.sensitivity),
            "spread": dict(self.spread),
            "numel": dict(self.numel),
            "grad_sq": self.grad_sq,
            "estimates": self.estimates,
            "predicted_error": self.predicted_error,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; checks all of it first and changes nothing on error."""
        super().load_state_dict(state)
        who = f"{self.name!r} policy state"
        plan = _mapping(state, "plan", who)
        for key, bits in plan.items():
            if bits is None and self.name == "acgc":  # AC-GC keeps such a tensor exact
                continue
            if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
                raise TypeError(f"{who}: plan[{key!r}] must be an int, got {bits!r}")
            if not self.min_bits <= bits <= self.max_bits:
                raise ValueError(
                    f"{who}: plan[{key!r}] = {bits} outside min_bits..max_bits = "
                    f"{self.min_bits}..{self.max_bits}"
                )
        sensitivity = _floats(state, "sensitivity", who, low=None)
        spread = _floats(state, "spread", who, low=0.0)
        numel = _mapping(state, "numel", who)
        for key, n in numel.items():
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ValueError(f"{who}: numel[{key!r}] must be an int >= 0, got {n!r}")
        missing = sorted(set(plan) - set(numel))
        if missing:
            raise ValueError(f"{who}: plan keys {missing[:3]} have no numel")
        grad_sq = _scalar(state, "grad_sq", who, 0.0, low=0.0)
        estimates = int(_scalar(state, "estimates", who, 0, low=0.0, integral=True))
        skipped = int(_scalar(state, "skipped", who, 0, low=0.0, integral=True))
        predicted = state.get("predicted_error", math.nan)
        if not isinstance(predicted, numbers.Real) or predicted < 0 or math.isinf(predicted):
            raise ValueError(f"{who}: predicted_error must be >= 0 or NaN, got {predicted!r}")
        self.plan = {str(k): (None if b is None else int(b)) for k, b in plan.items()}
        self.sensitivity, self.spread = sensitivity, spread
        self.numel = {str(k): int(n) for k, n in numel.items()}
        self.grad_sq, self.estimates, self.skipped = grad_sq, estimates, skipped
        self.predicted_error = float(predicted)


def _mapping(state: dict[str, Any], key: str, who: str) -> dict:
    value = state.get(key, {})
    if not isinstance(value, dict):
        raise TypeError(f"{who}: {key} must be a dict, got {type(value).__name__}")
    return value


def _floats(state: dict[str, Any], key: str, who: str, low: float | None) -> dict[str, float]:
    out = {}
    for k, v in _mapping(state, key, who).items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"{who}: {key}[{k!r}] must be a finite number, got {v!r}")
        if low is not None and v < low:
            raise ValueError(f"{who}: {key}[{k!r}] must be >= {low}, got {v!r}")
        out[str(k)] = float(v)
    return out


def _scalar(
    state: dict[str, Any], key: str, who: str, default: float, low: float, integral: bool = False
) -> float:
    v = state.get(key, default)
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(v, bool) or not isinstance(v, kind) or not math.isfinite(v) or v < low:
        raise ValueError(f"{who}: {key} must be a finite number >= {low}, got {v!r}")
    return float(v)


def _squared_distance(a: list[torch.Tensor], b: list[torch.Tensor] | None) -> torch.Tensor:
    """``sum_i ||a_i - b_i||^2`` (``||a_i||^2`` without ``b``) in float32, one gradient at a
    time: no flattened copy of every parameter's gradient a pass (a ResNet-50's 94 MB, with
    two more for the difference and its square)."""
    if b is not None and [t.shape for t in a] != [t.shape for t in b]:
        raise RuntimeError(
            "a sensitivity probe's gradients differ in shape from the baseline pass's: "
            "backprop must give the same parameters gradients in every pass"
        )
    total = torch.zeros((), dtype=torch.float32, device=a[0].device if a else None)
    for i, x in enumerate(a):
        d = x.float().square() if b is None else (x.float() - b[i].float()).square_()
        total += d.sum()
    return total


def _split(keys: list[str], parts: int) -> list[list[str]]:
    """``keys`` in order, cut into at most ``parts`` contiguous groups of near-equal size."""
    n = len(keys)
    parts = min(parts, n)
    return [keys[i * n // parts : (i + 1) * n // parts] for i in range(parts)]


class AutoPrecision(AdaptivePolicy):
    """GACT-style auto precision: minimise predicted gradient variance at ``avg_bits``.

    Greedy marginal allocation (optimal for this separable convex objective up to one step):
    every tensor starts at ``min_bits``; the next bit goes to the tensor whose predicted
    variance drops most per element, while the element-weighted average stays within budget.
    """

    name = "auto"

    def __init__(self, avg_bits: float = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(avg_bits, (int, float)) or not 1 <= avg_bits <= 8:
            raise ValueError(f"avg_bits must be a number in [1, 8], got {avg_bits!r}")
        self.avg_bits = float(avg_bits)

    def default_bits(self) -> int:
        return min(max(round(self.avg_bits), self.min_bits), self.max_bits)

    def _allocate(self, keys: list[str]) -> None:
        w = self._weights(keys)
        weights, costs = [w[k] for k in keys], [self.numel[k] for k in keys]
        # (the 1e-9: rounding of the float budget, which integer element counts cannot overrun)
        plan = allocate(
            weights, costs, self.min_bits, self.max_bits, budget=self.avg_bits, slack=1e-9
        )
        self.plan = dict(zip(keys, plan.bits, strict=True))
        total = plan.variance
        self.predicted_error = math.sqrt(total / self.grad_sq) if self.grad_sq > 0 else 0.0

    def __repr__(self) -> str:
        return f"AutoPrecision(avg_bits={self.avg_bits}, adapt_interval={self.adapt_interval})"


class ACGC(AdaptivePolicy):
    """AC-GC-style error-bounded bits: predicted ``||dg|| / ||g|| <= error_bound``.

    Bits per tensor are the fewest (greedy by predicted variance drop per element) for which
    ``sum_l c_l Q_l(b_l) <= safety * error_bound^2 * ||g||^2``; past ``max_bits`` a tensor is
    kept uncompressed. Until the first estimate and for tensors never measured, ``max_bits``.
    """

    name = "acgc"

    def __init__(
        self, error_bound: float = 0.1, *, safety: float = 0.5, min_bits: int = 2, **kwargs: Any
    ) -> None:
        super().__init__(min_bits=min_bits, **kwargs)
        if (
            isinstance(error_bound, bool)
            or not isinstance(error_bound, (int, float))
            or not math.isfinite(error_bound)
            or error_bound <= 0
        ):
            raise ValueError(f"error_bound must be a finite positive number, got {error_bound!r}")
        if not isinstance(safety, (int, float)) or not 0 < safety <= 1:
            raise ValueError(f"safety must be in (0, 1], got {safety!r}")
        self.error_bound = float(error_bound)
        self.safety = float(safety)

    def default_bits(self) -> int:
        return self.max_bits

    def _allocate(self, keys: list[str]) -> None:
        w = self._weights(keys)
        weights, costs = [w[k] for k in keys], [self.numel[k] for k in keys]
        target = self.safety * self.error_bound**2 * self.grad_sq
        plan = allocate(weights, costs, self.min_bits, self.max_bits, target=target)
        self.plan = dict(zip(keys, plan.bits, strict=True))
        total = plan.variance
        self.predicted_error = math.sqrt(max(total, 0.0) / self.grad_sq) if self.grad_sq else 0.0

    def __repr__(self) -> str:
        return f"ACGC(error_bound={self.error_bound}, adapt_interval={self.adapt_interval})"
