"""``ZeroValue``: a ReLU output kept as its known 1-bit mask plus its nonzeros (AC-GC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from .base import Compressor, Tensors
from .quantize import Quantize

__all__ = ["ZeroValue"]

_FUSED = "masked"  # ZeroValue meta tag: packed by ops.masked_quantize


@dataclass(frozen=True)
class ZeroValue(Compressor):
    """A tensor whose zeros are exactly a known 1-bit mask's zeros (a ReLU output).

    Keeps the mask tensor (shared with whoever saved it first, so it costs nothing twice)
    and the nonzero values only, compressed by ``inner`` (AC-GC's zero-value compression).
    With a one-row :class:`Quantize` as ``inner`` (what every route uses) the values are
    read and written at the mask's bits by :func:`actcore.ops.masked_quantize` and
    :func:`actcore.ops.masked_dequantize`, never searched for: the same bytes as quantizing
    ``x[x != 0]``. A ``seed`` attribute of ``inner`` (``SeededQuantize``) fixes the rounding.
    """

    mask: torch.Tensor  # pack_mask(x != 0), already saved by the layer that made x
    inner: Compressor
    name = "zero_value"
    lossy = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """The zeros are exact; the values as ``inner``."""
        return self.inner.unbiased

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        q = self.inner
        if isinstance(q, Quantize) and not q.per_sample:
            seed = getattr(q, "seed", None)
            p = ops.masked_quantize(
                x, self.mask, q.bits, group_size=q.group_size, stochastic=q.stochastic, seed=seed
            )
            return (self.mask, *p), (_FUSED, x.shape, x.dtype, q.bits, q.group_size)
        values, meta = q.pack(x[x != 0])
        return (self.mask, *values), (x.shape, meta)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        if meta[0] == _FUSED:
            _, shape, dtype, bits, group_size = meta
            mask, payload, lo, step = tensors
            return ops.masked_dequantize(payload, lo, step, mask, bits, group_size, shape, dtype)
        shape, inner_meta = meta
        values = self.inner.unpack(tensors[1:], inner_meta)
        out = values.new_zeros(shape)
        out[ops.unpack_mask(tensors[0], shape)] = values
        return out

    def key(self) -> tuple:
        return (self.name, id(self.mask), *self.inner.key())
