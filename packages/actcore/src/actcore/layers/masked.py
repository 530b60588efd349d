"""Q-layers that keep a 1-bit mask at every level: the ReLU family and dropout."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..rng import transforms_active
from .base import QLayer
from .masked_functions import (
    DropoutFunction,
    MaskedActivationFunction,
    note_dropout_output,
    note_output_mask,
)
from .stash import needs_saving

__all__ = [
    "QDropout",
    "QHardtanh",
    "QLeakyReLU",
    "QReLU",
    "QReLU6",
]


class _QMasked(QLayer):
    """Two-valued derivative: a 1-bit mask at every level (exact)."""

    def _kind(self) -> tuple[str, Any]:
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not needs_saving(input) or transforms_active():  # (a transform: at L0 only)
            return super().forward(input)
        kind, param = self._kind()
        out = MaskedActivationFunction.apply(input, kind, param, self.inplace, self)
        return note_output_mask(out) if kind == "relu" else out


class QReLU(_QMasked, nn.ReLU):
    def _kind(self):
        return "relu", None


class QLeakyReLU(_QMasked, nn.LeakyReLU):
    def _kind(self):
        return "leaky_relu", self.negative_slope


class QHardtanh(_QMasked, nn.Hardtanh):
    def _kind(self):
        return "hardtanh", (self.min_val, self.max_val)


class QReLU6(_QMasked, nn.ReLU6):
    def _kind(self):
        return "hardtanh", (self.min_val, self.max_val)


class QDropout(QLayer, nn.Dropout):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and 0 < self.p < 1 and needs_saving(input)) or transforms_active():
            return super().forward(input)
        return note_dropout_output(DropoutFunction.apply(input, self.p, self.inplace, self))
