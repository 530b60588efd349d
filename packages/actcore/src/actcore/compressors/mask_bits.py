"""``MaskBits``: a bool tensor (a dropout mask, a comparison) at 1 bit per element."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .. import ops
from .base import Compressor

__all__ = ["MaskBits"]


@dataclass(frozen=True)
class MaskBits(Compressor):
    """A bool tensor at 1 bit per element (lossless)."""

    name = "mask"

    def pack(self, x: Tensor) -> tuple[tuple[Tensor, ...], Any]:
        return (ops.pack_mask(x.contiguous()),), x.shape

    def unpack(self, tensors: tuple[Tensor, ...], meta: Any) -> Tensor:
        return ops.unpack_mask(tensors[0], meta)
