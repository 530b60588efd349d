"""Autograd functions of the pooling Q-layers.

Max pooling keeps each output's argmax as a few-bit offset inside its window; average
pooling keeps nothing (its backward needs only the input's shape).
"""

from __future__ import annotations

import math

import torch

from .. import ops
from ..ops.pool_index import flat_index, offset_bits, window_offset
from .input_meta import InputMeta
from .stash import IDENTITY, stash, unstash

__all__ = [
    "AvgPoolFunction",
    "MaxPoolFunction",
]

aten = torch.ops.aten


class MaxPoolFunction(torch.autograd.Function):
    """Max pooling that keeps each output's argmax as its offset inside the window.

    The offset needs ``ceil(log2(window size))`` bits per output element instead of an
    int64 flat index; backward rebuilds the flat indices for the aten backward op.
    """

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode, layer):
        nd = len(kernel)
        pool = torch.nn.functional.max_pool2d if nd == 2 else torch.nn.functional.max_pool3d
        out, index = pool(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        window = math.prod(kernel)
        bits = offset_bits(kernel)
        ctx.geometry = (kernel, stride, padding, dilation, ceil_mode)
        ctx.input_meta = InputMeta(x)
        ctx.out_shape, ctx.bits = out.shape, bits
        offset = window_offset(index, x.shape[-nd:], *ctx.geometry[:4])
        del index
        if bits <= 8:
            saved = ops.pack_bits(offset.to(torch.uint8), bits)
        else:
            saved = offset.to(torch.int16 if window <= 2**15 else torch.int32)
        stash(ctx, layer, [(saved, IDENTITY)])
        return out

    @staticmethod
    def backward(ctx, grad):
        (saved,) = unstash(ctx)
        if ctx.bits <= 8:
            offset = ops.unpack_bits(saved, ctx.bits, math.prod(ctx.out_shape))
            offset = offset.view(ctx.out_shape)
        else:
            offset = saved
        kernel, stride, padding, dilation, ceil_mode = ctx.geometry
        nd = len(kernel)
        x_meta = ctx.input_meta.tensor()
        index = flat_index(offset, x_meta.shape[-nd:], kernel, stride, padding, dilation)
        backward = (
            aten.max_pool2d_with_indices_backward
            if nd == 2
            else aten.max_pool3d_with_indices_backward
        )
        gx = backward(grad, x_meta, kernel, stride, padding, dilation, ceil_mode, index)
        return gx, None, None, None, None, None, None


class AvgPoolFunction(torch.autograd.Function):
    """Average pooling that saves nothing: its backward needs only the input's shape."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor, layer):
        nd = len(kernel)
        if nd == 2:
            out = aten.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        else:
            out = aten.avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.input_meta = InputMeta(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        backward = aten.avg_pool2d_backward if len(ctx.args[0]) == 2 else aten.avg_pool3d_backward
        gx = backward(grad, ctx.input_meta.tensor(), *ctx.args)
        return gx, None, None, None, None, None, None, None
