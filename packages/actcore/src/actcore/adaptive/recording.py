"""Adaptive bits' statistics tap: :class:`Recording` wraps the compressor the plan chose
and reports what it packed to the scheme, whose statistics then come from the quantizer's
own per-group steps (no pass over the tensor of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..compressors import Compressor, Quantize, Tensors, ZeroValue
from ..compressors.base import Wrapping
from .stats import LayerStats

__all__: list[str] = []


class _Recorder(Protocol):
    """What a :class:`Recording` reports to (:class:`~actcore.adaptive.AdaptiveBits`)."""

    def _take(self, stats: LayerStats, profile: torch.Tensor, elems: float) -> None: ...


@dataclass(frozen=True, eq=False)
class Recording(Wrapping):
    """``inner``, handing the statistics of what it packed to the scheme's ``_take`` (read
    off the quantizer's own per-group steps, no pass over the tensor of its own). Packs,
    unpacks and compares as ``inner``."""

    inner: Compressor
    scheme: _Recorder
    stats: LayerStats
    samples: int
    elems: float  # elements stored per sample (zero-value: counted from the payload)
    scale: torch.Tensor | None = None  # per-sample gradient weights (set_sample_index)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        tensors, meta = self.inner.pack(x)
        with torch.no_grad():
            self.scheme._take(self.stats, *self._statistics(tensors))
        return tensors, meta

    def _statistics(self, tensors: Tensors) -> tuple[torch.Tensor, float]:
        """The range-weight profile (largest first) and elements per sample of a packing.

        Stochastic rounding of a group of range ``r`` at ``b`` bits has step ``r / (2^b - 1)``
        (up to its rounding to bfloat16), so ``group_size * (step * (2^b - 1))^2`` is the
        group's term of :func:`~actcore.compressors.sample_range_weights`.
        """
        inner = self.inner
        if isinstance(inner, ZeroValue):  # (mask, payload, lo, step): one row, all samples
            q = inner.inner
            assert isinstance(q, Quantize)
            payload, step = tensors[1], tensors[3]
            levels = float(2**q.bits - 1)
            total = step.float().square().sum() * (q.group_size * levels**2)
            profile = (total / self.samples).reshape(1).expand(self.samples)
            stored = payload.shape[-1] // q.bits * 8  # the nonzeros (to a multiple of 8)
            return profile, stored / self.samples
        assert isinstance(inner, Quantize)
        step = tensors[2]
        levels = float(2**inner.bits - 1)
        weights = step.float().square().sum(1) * (inner.group_size * levels**2)
        if self.scale is not None:
            weights = weights * self.scale
        return weights.sort(descending=True).values, self.elems

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return self.inner.unpack(tensors, meta)

    def key(self) -> tuple:
        return self.inner.key()

    def __eq__(self, other: object) -> bool:
        inner = other.inner if isinstance(other, Recording) else other
        return self.inner == inner

    def __hash__(self) -> int:
        return hash(self.inner)
