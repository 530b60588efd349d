"""``Quantize``: per-group stochastic k-bit quantization of a saved tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from .base import Compressor, Tensors

__all__ = ["Quantize"]


@dataclass(frozen=True)
class Quantize(Compressor):
    """Per-group stochastic k-bit quantization (:func:`actcore.ops.quantize`)."""

    bits: int
    group_size: int = 256
    per_sample: bool = True
    stochastic: bool = True
    name = "quantize"
    lossy = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Stochastic rounding is unbiased; rounding to nearest is not."""
        return self.stochastic

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        p = ops.quantize(
            x,
            self.bits,
            group_size=self.group_size,
            stochastic=self.stochastic,
            per_sample=self.per_sample,
        )
        return p.tensors(), (p.shape, p.dtype, p.bits, p.group_size, p.per_sample)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return ops.dequantize(ops.Packed(*tensors, *meta))

    def pack_scaled(
        self, x: torch.Tensor, multipliers: torch.Tensor, inner: int
    ) -> tuple[Tensors, Any]:
        """:meth:`pack` of ``x`` with its channels multiplied first, in one pass
        (:func:`actcore.ops.quantize_scaled`): what :meth:`unpack_scaled` reverses."""
        p = ops.quantize_scaled(
            x,
            multipliers,
            inner,
            self.bits,
            group_size=self.group_size,
            stochastic=self.stochastic,
            per_sample=self.per_sample,
        )
        return p.tensors(), (p.shape, p.dtype, p.bits, p.group_size, p.per_sample)

    def unpack_scaled(
        self, tensors: Tensors, meta: Any, multipliers: torch.Tensor, inner: int
    ) -> torch.Tensor:
        """:meth:`unpack` with the channels then multiplied, in one pass."""
        return ops.dequantize_scaled(ops.Packed(*tensors, *meta), multipliers, inner)

    def key(self) -> tuple:
        return (self.name, self.bits, self.group_size, self.per_sample, self.stochastic)
