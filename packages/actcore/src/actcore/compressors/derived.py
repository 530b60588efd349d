"""``Derived``: a tensor rebuilt in backward from packings that others hold anyway."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import Compressor, Packing, Tensors
from .restoring import restore

__all__ = ["Derived"]


@dataclass(frozen=True, eq=False)
class Derived(Compressor):
    """A tensor rebuilt from other packings: ``fn(*restored parts)``.

    The parts are packings held anyway by whoever saved them (a norm's compressed input, an
    activation's input, the operands of a product, a dropout's mask), so keeping a tensor
    this way costs nothing: a normalization's output, an activation's output, a gated
    product, a dropout output. ``pack`` is not used (:func:`actcore.layers.stash.packing_of`
    builds the tensors, the parts' tensors one after the other, and the meta, the parts'
    metas and tensor counts). Approximate like its parts: never for what must stay exact.
    """

    fn: Callable[..., torch.Tensor]
    parts: tuple[Compressor | None, ...]  # None: a None argument of fn
    # fn is affine in each part (a norm's affine output, a dropout's mask times its input):
    # then E[fn(restored)] == fn(parts) when the parts are unbiased and independent
    affine: bool = False
    name = "derived"
    lossy = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Unbiased parts through an affine ``fn``; a curved ``fn`` (a smooth activation
        rebuilt from its rounded input) is not: ``E[f(q(x))] != f(x)``."""
        return self.affine and all(c is None or c.unbiased for c in self.parts)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        metas, counts = meta
        restored, i = [], 0
        for comp, part_meta, n in zip(self.parts, metas, counts, strict=True):
            restored.append(None if comp is None else restore(comp, tensors[i : i + n], part_meta))
            i += n
        with torch.no_grad():
            return self.fn(*restored)

    def parts_of(self, tensors: Tensors, meta: Any) -> tuple[Packing, ...]:
        metas, counts = meta
        parts, i = [], 0
        for comp, part_meta, n in zip(self.parts, metas, counts, strict=True):
            if comp is not None:
                parts.append(Packing(comp, tuple(tensors[i : i + n]), part_meta))
            i += n
        return tuple(parts)

    def key(self) -> tuple:
        return (self.name, id(self.fn), *(c and c.key() for c in self.parts))
