"""Adaptive bits' statistics tap: :class:`RangeTap`, handed what the plan's compressor
packed (a :class:`~actcore.compressors.Tapped`), reports it to the scheme, whose statistics
then come from the quantizer's own per-group steps (no pass over the tensor of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..compressors import Compressor, Quantize, Tapped, Tensors, ZeroValue
from .stats import LayerStats

__all__: list[str] = []


class _Recorder(Protocol):
    """What a :class:`RangeTap` reports to (:class:`~actcore.adaptive.AdaptiveBits`)."""

    def _take(self, stats: LayerStats, profile: torch.Tensor, elems: float) -> None: ...


@dataclass(frozen=True, eq=False)
class RangeTap:
    """Hands ``scheme._take`` the statistics of what ``packer`` (a :class:`Quantize`, or a
    :class:`ZeroValue` around one) packed for one layer."""

    packer: Compressor
    scheme: _Recorder
    stats: LayerStats
    samples: int
    elems: float  # elements stored per sample (zero-value: counted from the payload)
    scale: torch.Tensor | None = None  # per-sample gradient weights (set_sample_index)

    def __call__(self, x: torch.Tensor, tensors: Tensors) -> None:
        self.scheme._take(self.stats, *self._statistics(tensors))

    def _statistics(self, tensors: Tensors) -> tuple[torch.Tensor, float]:
        """The range-weight profile (largest first) and elements per sample of a packing.

        Stochastic rounding of a group of range ``r`` at ``b`` bits has step ``r / (2^b - 1)``
        (up to its rounding to bfloat16), so ``group_size * (step * (2^b - 1))^2`` is the
        group's term of :func:`~actcore.compressors.sample_range_weights`.
        """
        packer = self.packer
        if isinstance(packer, ZeroValue):  # (mask, payload, lo, step): one row, all samples
            q = packer.inner
            assert isinstance(q, Quantize)
            payload, step = tensors[1], tensors[3]
            levels = float(2**q.bits - 1)
            total = step.float().square().sum() * (q.group_size * levels**2)
            profile = (total / self.samples).reshape(1).expand(self.samples)
            stored = payload.shape[-1] // q.bits * 8  # the nonzeros (to a multiple of 8)
            return profile, stored / self.samples
        assert isinstance(packer, Quantize)
        step = tensors[2]
        levels = float(2**packer.bits - 1)
        weights = step.float().square().sum(1) * (packer.group_size * levels**2)
        if self.scale is not None:
            weights = weights * self.scale
        return weights.sort(descending=True).values, self.elems


def recording(
    packer: Compressor,
    scheme: _Recorder,
    stats: LayerStats,
    samples: int,
    elems: float,
    scale: torch.Tensor | None = None,
) -> Tapped:
    """``packer``, its packings reported to ``scheme`` (keyed and compared as ``packer``)."""
    return Tapped(packer, RangeTap(packer, scheme, stats, samples, elems, scale))
