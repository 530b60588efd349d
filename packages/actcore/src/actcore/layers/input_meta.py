"""An input's shape, dtype and device, for backward ops that read only those."""

from __future__ import annotations

import torch

__all__ = ["InputMeta"]


class InputMeta:
    """``x``'s shape, dtype and device, for backward ops that read only those of an input.

    Holds no tensor (so nothing is counted as kept for backward); ``tensor()`` builds a
    one-element stand-in expanded to the shape when backward needs it.
    """

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, x: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device

    def tensor(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)
