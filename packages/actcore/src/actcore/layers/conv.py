"""Q-layers of conv, transposed conv and linear: the layers whose weight multiplies their
input, which they keep (compressed) only for the weight gradient."""

from __future__ import annotations

import torch
from torch import nn

from .autocast import LOWER_PRECISION, autocast_inputs
from .base import QLayer
from .conv_functions import ConvFunction, LinearFunction
from .double_backward import link
from .loss import note_linear_output

__all__ = [
    "QConv1d",
    "QConv2d",
    "QConv3d",
    "QConvTranspose1d",
    "QConvTranspose2d",
    "QConvTranspose3d",
    "QLinear",
]


def _numeric_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...]:
    if module.padding == "valid":
        return (0,) * len(module.kernel_size)
    if module.padding == "same":
        return tuple(
            d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size, strict=True)
        )
    return tuple(module.padding)


class _QConvNd(QLayer):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        nd = len(self.kernel_size)
        if self.padding_mode != "zeros":  # torch pads first, then convolves without padding
            input = nn.functional.pad(
                input, self._reversed_padding_repeated_twice, self.padding_mode
            )
            padding = (0,) * nd
        else:
            padding = _numeric_padding(self)
        args = (self.stride, padding, self.dilation, False, (0,) * nd, self.groups)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        return ConvFunction.apply(input, weight, bias, self, args, link(input))


class QConv1d(_QConvNd, nn.Conv1d):
    pass


class QConv2d(_QConvNd, nn.Conv2d):
    pass


class QConv3d(_QConvNd, nn.Conv3d):
    pass


class _QConvTransposeNd(QLayer):
    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input, output_size)
        nd = len(self.kernel_size)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, nd, self.dilation
        )
        args = (self.stride, self.padding, self.dilation, True, output_padding, self.groups)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        return ConvFunction.apply(input, weight, bias, self, args, link(input))


class QConvTranspose1d(_QConvTransposeNd, nn.ConvTranspose1d):
    pass


class QConvTranspose2d(_QConvTransposeNd, nn.ConvTranspose2d):
    pass


class QConvTranspose3d(_QConvTransposeNd, nn.ConvTranspose3d):
    pass


class QLinear(QLayer, nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._compresses(input, self.weight, self.bias):
            return super().forward(input)
        input, weight, bias = autocast_inputs(LOWER_PRECISION, input, self.weight, self.bias)
        out = LinearFunction.apply(input, weight, bias, self, link(input))
        note_linear_output(out, input, weight, bias, self)  # a cross-entropy can recompute it
        return out
