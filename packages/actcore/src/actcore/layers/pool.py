"""Q-layers of max and average pooling (1-d pooled as 2-d over a unit height, as torch)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.utils import _ntuple

from ..rng import transforms_active
from .autocast import autocast_inputs
from .base import QLayer
from .pool_functions import AvgPoolFunction, MaxPoolFunction
from .stash import needs_saving

__all__ = [
    "QAvgPool1d",
    "QAvgPool2d",
    "QAvgPool3d",
    "QMaxPool1d",
    "QMaxPool2d",
    "QMaxPool3d",
]


def _unsqueezed_1d(fn, input: torch.Tensor, *args) -> torch.Tensor:
    return fn(input.unsqueeze(-2), *args).squeeze(-2)


class _QMaxPoolNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.return_indices or not needs_saving(input) or transforms_active():
            return super().forward(input)
        nd = self._nd
        tup = _ntuple(nd)
        kernel = tup(self.kernel_size)
        stride = tup(self.stride if self.stride is not None else self.kernel_size)
        geometry = (kernel, stride, tup(self.padding), tup(self.dilation))
        if nd == 1:  # torch pools 1-d as 2-d over a unit height
            geometry = tuple((1 if i != 2 else 0, *g) for i, g in enumerate(geometry))
            return _unsqueezed_1d(
                lambda x: MaxPoolFunction.apply(x, *geometry, self.ceil_mode, self), input
            )
        return MaxPoolFunction.apply(input, *geometry, self.ceil_mode, self)


class QMaxPool1d(_QMaxPoolNd, nn.MaxPool1d):
    _nd = 1


class QMaxPool2d(_QMaxPoolNd, nn.MaxPool2d):
    _nd = 2


class QMaxPool3d(_QMaxPoolNd, nn.MaxPool3d):
    _nd = 3


class _QAvgPoolNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not needs_saving(input) or transforms_active():  # (a transform: at L0 only)
            return super().forward(input)
        nd = self._nd
        (input,) = autocast_inputs(f"avg_pool{nd}d", input)
        tup = _ntuple(nd)
        kernel = tup(self.kernel_size)
        stride = tup(self.stride if self.stride is not None else self.kernel_size)
        padding = tup(self.padding)
        divisor = getattr(self, "divisor_override", None)
        if nd == 1:
            kernel, stride, padding = (1, *kernel), (1, *stride), (0, *padding)
            return _unsqueezed_1d(
                lambda x: AvgPoolFunction.apply(
                    x, kernel, stride, padding, self.ceil_mode, self.count_include_pad, None, self
                ),
                input,
            )
        return AvgPoolFunction.apply(
            input, kernel, stride, padding, self.ceil_mode, self.count_include_pad, divisor, self
        )


class QAvgPool1d(_QAvgPoolNd, nn.AvgPool1d):
    _nd = 1


class QAvgPool2d(_QAvgPoolNd, nn.AvgPool2d):
    _nd = 2


class QAvgPool3d(_QAvgPoolNd, nn.AvgPool3d):
    _nd = 3
