"""Compressors: turn a tensor saved for backward into a few compact tensors and back.

A compressor's ``pack(x)`` returns ``(tensors, meta)``: the tensors go through
``ctx.save_for_backward`` (so autograd's in-place checks, saved-tensor hooks and memory
accounting all see them), ``meta`` is small Python data. ``unpack(tensors, meta)`` rebuilds
the tensor. Both front doors (Q-layers and saved-tensor hooks) use these same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import ops

Tensors = tuple[torch.Tensor, ...]


class Compressor:
    """Base class: identity (keeps the tensor itself)."""

    name = "identity"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        return (x,), None

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return tensors[0]

    def key(self) -> tuple:
        """Identifies the result of ``pack``: equal keys pack a tensor identically."""
        return (self.name,)


IDENTITY = Compressor()


@dataclass(frozen=True)
class Quantize(Compressor):
    """Per-group stochastic k-bit quantization (:func:`actcore.ops.quantize`)."""

    bits: int
    group_size: int = 256
    per_sample: bool = True
    stochastic: bool = True
    name = "quantize"

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

    def key(self) -> tuple:
        return (self.name, self.bits, self.group_size, self.per_sample, self.stochastic)


@dataclass(frozen=True)
class ZeroValue(Compressor):
    """A tensor whose zeros are exactly a known 1-bit mask's zeros (a ReLU output).

    Keeps the mask tensor (shared with whoever saved it first, so it costs nothing twice)
    and the nonzero values only, compressed by ``inner`` (AC-GC's zero-value compression).
    """

    mask: torch.Tensor  # pack_mask(x != 0), already saved by the layer that made x
    inner: Compressor
    name = "zero_value"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        values, meta = self.inner.pack(x[x != 0])
        return (self.mask, *values), (x.shape, meta)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        shape, inner_meta = meta
        values = self.inner.unpack(tensors[1:], inner_meta)
        out = values.new_zeros(shape)
        out[ops.unpack_mask(tensors[0], shape)] = values
        return out

    def key(self) -> tuple:
        return (self.name, id(self.mask), *self.inner.key())


@dataclass(frozen=True)
class Swap(Compressor):
    """Moves what ``inner`` packs to pinned CPU memory, asynchronously; back in backward.

    On a CPU tensor it is ``inner`` alone (there is nowhere to swap to).
    """

    inner: Compressor = IDENTITY
    name = "swap"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        tensors, meta = self.inner.pack(x)
        if x.device.type != "cuda":
            return tensors, (None, meta)
        host = []
        for t in tensors:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        return tuple(host), (x.device, meta)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        device, inner_meta = meta
        if device is not None:
            tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
        return self.inner.unpack(tensors, inner_meta)

    def key(self) -> tuple:
        return (self.name, *self.inner.key())
