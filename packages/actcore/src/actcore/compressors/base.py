"""The compressor protocol, and the identity compressor that keeps a tensor as it is.

A compressor's ``pack(x)`` returns ``(tensors, meta)``: the tensors go through
``ctx.save_for_backward`` (so autograd's in-place checks, saved-tensor hooks and memory
accounting all see them), ``meta`` is small Python data. ``unpack(tensors, meta)`` rebuilds
the tensor. Both routes (Q-layers and saved-tensor hooks) use the same objects, and keep
what one made as a :class:`Packing`: the compressor with its tensors and meta.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["IDENTITY", "Compressor", "Packing", "Tensors", "Wrapping"]

Tensors = tuple[torch.Tensor, ...]


class Compressor:
    """Base class: identity (keeps the tensor itself)."""

    name = "identity"
    lossy = False  # whether unpack(pack(x)) may differ from x
    # whether E[unpack(pack(x))] == x: a gradient linear in the saved tensor (a weight's,
    # a mask's) is then unbiased; exact compressors are trivially
    unbiased = True

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        return (x,), None

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return tensors[0]

    def key(self) -> tuple:
        """Identifies the result of ``pack``: equal keys pack a tensor identically."""
        return (self.name,)

    def parts_of(self, tensors: Tensors, meta: Any) -> tuple[Packing, ...]:
        """The packings (held by others too) that ``unpack`` restores ``tensors`` from:
        none but for a tensor rebuilt from others (:class:`~actcore.compressors.Derived`)."""
        return ()


IDENTITY = Compressor()


class Packing(NamedTuple):
    """What ``compressor.pack`` made of a tensor, with the compressor that unpacks it."""

    compressor: Compressor
    tensors: Tensors
    meta: Any


class Wrapping(Compressor):
    """Base of a compressor around another one, its ``inner`` (a field of the subclass):
    as lossy and as unbiased as ``inner``."""

    inner: Compressor

    @property
    def lossy(self) -> bool:  # type: ignore[override]
        return self.inner.lossy

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.inner.unbiased
