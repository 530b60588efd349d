"""ScoredPerSampleQuantize: per-sample bits with the samples ranked by given scores
(adaptive bits' per-dataset-sample gradient weights, :mod:`actcore.adaptive`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import Tensors
from .per_sample_quantize import PerSampleQuantize
from .quantize import Quantize

__all__ = ["ScoredPerSampleQuantize"]


@dataclass(frozen=True, eq=False)
class ScoredPerSampleQuantize(PerSampleQuantize):
    """:class:`PerSampleQuantize` ranking samples by given ``scores`` (largest first).

    Packs into the same layout, so :meth:`PerSampleQuantize.unpack` reads it back.
    """

    scores: torch.Tensor | None = None  # [N], on x's device

    name = "scored_per_sample_quantize"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        if self.scores is None or self.scores.shape != (x.shape[0],):
            raise ValueError(f"scores do not match a batch of {x.shape[0]}")
        if sum(c for _, c in self.counts) != x.shape[0]:
            raise ValueError(f"counts {self.counts} do not cover a batch of {x.shape[0]}")
        order = torch.argsort(self.scores, descending=True)
        ranked = x.detach().index_select(0, order)
        tensors: list[torch.Tensor] = [order.to(torch.int32)]
        metas = []
        start = 0
        for bits, count in self.counts:
            if count:
                part, meta = Quantize(bits, self.group_size, True, self.stochastic).pack(
                    ranked[start : start + count]
                )
                tensors.extend(part)
                metas.append(meta)
                start += count
        return tuple(tensors), tuple(metas)

    def key(self) -> tuple:
        return (*super().key(), id(self.scores))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScoredPerSampleQuantize) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())
