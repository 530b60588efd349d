"""``Tapped``: packs with an inner compressor and hands each packing to a tap.

The one way statistics are read off what is packed: adaptive bits' plan
(:class:`actcore.adaptive.recording.RangeTap`) and an adaptive policy's estimate on the
layer route (:class:`actcore.policy_scheme.PolicyScheme`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import Compressor, Tensors, Wrapping

__all__ = ["Tapped"]


@dataclass(frozen=True, eq=False)
class Tapped(Wrapping):
    """``inner``, handing every packing to ``tap(x, tensors)`` (under ``no_grad``).

    Without a ``tag`` it keys and compares as ``inner``: a packing of the same tensor made
    by ``inner`` may be reused for it (the tap then sees nothing, as when adaptive bits
    find a tensor packed already). With a ``tag`` its key is its own, ``("tapped", *tag,
    *inner.key())``, so only its own earlier packing is reused.
    """

    inner: Compressor
    tap: Callable[[torch.Tensor, Tensors], None]
    tag: tuple = ()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        tensors, meta = self.inner.pack(x)
        with torch.no_grad():
            self.tap(x, tensors)
        return tensors, meta

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return self.inner.unpack(tensors, meta)

    def key(self) -> tuple:
        return ("tapped", *self.tag, *self.inner.key()) if self.tag else self.inner.key()

    def __eq__(self, other: object) -> bool:
        if self.tag:
            return self is other
        if isinstance(other, Tapped) and not other.tag:
            other = other.inner
        return self.inner == other

    def __hash__(self) -> int:
        return id(self) if self.tag else hash(self.inner)
