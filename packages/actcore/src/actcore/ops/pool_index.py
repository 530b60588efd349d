"""A max pool's argmax as a flat index into its input's plane, and as an offset inside its
pooling window: ``ceil(log2(window size))`` bits an output element where the flat index takes
an int64 (kept by the pooling Q-layers, and by compiled graphs' packing of saved indices)."""

from __future__ import annotations

import math

import torch

__all__ = ["flat_index", "offset_bits", "window_offset"]


def offset_bits(kernel) -> int:
    """The bits that hold an offset inside a window of ``kernel``'s size."""
    return max(1, math.ceil(math.log2(math.prod(kernel))))


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


def window_offset(index, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
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


def flat_index(offset, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
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
