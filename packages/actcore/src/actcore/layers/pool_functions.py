"""Autograd functions of the pooling Q-layers.

Max pooling keeps each output's argmax as a few-bit offset inside its window; average
pooling keeps nothing (its backward needs only the input's shape).
"""

from __future__ import annotations

import math

import torch

from .. import ops
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
        bits = max(1, math.ceil(math.log2(window)))
        ctx.geometry = (kernel, stride, padding, dilation, ceil_mode)
        ctx.input_meta = InputMeta(x)
        ctx.out_shape, ctx.bits = out.shape, bits
        offset = _window_offset(index, x.shape[-nd:], *ctx.geometry[:4])
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
        index = _flat_index(offset, x_meta.shape[-nd:], kernel, stride, padding, dilation)
        backward = (
            aten.max_pool2d_with_indices_backward
            if nd == 2
            else aten.max_pool3d_with_indices_backward
        )
        gx = backward(grad, x_meta, kernel, stride, padding, dilation, ceil_mode, index)
        return gx, None, None, None, None, None, None


def _index_dtype(in_spatial) -> torch.dtype:
    """int32 where a per-plane flat index fits (it always does but for planes over 2**31
    elements): half the bytes of int64 for the temporaries of the conversions below."""
    return torch.int32 if math.prod(in_spatial) < 2**31 else torch.int64


def _window_starts(out_shape, stride, padding, device, dtype) -> list[torch.Tensor]:
    """Per spatial dim, the (broadcastable) input coordinate where each window starts."""
    nd = len(stride)
    starts = []
    for d in range(nd):
        size = out_shape[-nd + d]
        view = [1] * nd
        view[d] = size
        pos = torch.arange(size, device=device, dtype=dtype) * stride[d] - padding[d]
        starts.append(pos.view(view))
    return starts


def _peel(rest: torch.Tensor, radix: int, last: bool) -> torch.Tensor:
    """The least significant digit of ``rest`` in ``radix``, ``rest`` divided in place;
    the most significant (``last``) is ``rest`` itself."""
    if last:
        return rest
    digit = rest.remainder(radix)
    rest.div_(radix, rounding_mode="floor")
    return digit


def _window_offset(index, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
    """Flat input index (per plane, int64) -> offset inside the pooling window.

    Computed in place on one narrow copy of ``index`` (at most one more tensor of its size
    per spatial dim alive): the argmax of a large input is the largest tensor of the step.
    """
    nd = len(kernel)
    dtype = _index_dtype(in_spatial)
    starts = _window_starts(index.shape, stride, padding, index.device, dtype)
    rest = index.to(dtype)  # index itself for huge planes: the caller drops it
    coords: list[torch.Tensor | None] = [None] * nd
    for d in reversed(range(nd)):  # input coordinates, the least significant first
        coord = _peel(rest, in_spatial[d], d == 0).sub_(starts[d])
        if dilation[d] != 1:
            coord.div_(dilation[d], rounding_mode="floor")
        coords[d] = coord
    offset = coords[0]
    assert offset is not None
    for d in range(1, nd):
        offset.mul_(kernel[d]).add_(coords[d])
        coords[d] = None  # freed as soon as added
    return offset


def _flat_index(offset, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
    """Offset inside the pooling window -> flat input index (per plane, int64)."""
    nd = len(kernel)
    dtype = _index_dtype(in_spatial)
    starts = _window_starts(offset.shape, stride, padding, offset.device, dtype)
    rest = offset.to(dtype, copy=True)  # never the saved tensor itself (retain_graph)
    index = None
    for d in reversed(range(nd)):  # window coordinates, the least significant first
        within = _peel(rest, kernel[d], d == 0)
        if dilation[d] != 1:
            within.mul_(dilation[d])
        within.add_(starts[d])
        plane_stride = math.prod(in_spatial[d + 1 :])
        if plane_stride != 1:
            within.mul_(plane_stride)
        index = within if index is None else index.add_(within)
        del within
    assert index is not None
    return index.long()


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
