"""``SeededQuantize``: :class:`~actcore.compressors.Quantize` with a fixed rounding seed.

Adaptive policies use it while they estimate sensitivities: every pass of one estimate must
round each tensor with the same (or a deliberately different) seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .. import ops
from .quantize import Quantize

__all__ = ["SeededQuantize"]


@dataclass(frozen=True)
class SeededQuantize(Quantize):
    """:class:`Quantize` with a fixed rounding seed (used while policies estimate noise)."""

    seed: int = 0

    def pack(self, x: Tensor) -> tuple[tuple[Tensor, ...], Any]:
        p = ops.quantize(
            x, self.bits, group_size=self.group_size, per_sample=self.per_sample, seed=self.seed
        )
        return p.tensors(), (p.shape, p.dtype, p.bits, p.group_size, p.per_sample)

    def key(self) -> tuple:
        return (*super().key(), self.seed)
