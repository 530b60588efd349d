"""Autograd functions of the Q-layers that keep a 1-bit mask: the ReLU family, dropout.

The backward of these layers needs only which elements passed, so every level keeps that
mask at one bit per element (exact).
"""

from __future__ import annotations

import torch

from .. import ops
from .stash import IDENTITY, derive_output, note_mask, note_output, source_part, stash, unstash

__all__ = [
    "DropoutFunction",
    "MaskedActivationFunction",
    "dropout_backward",
    "dropout_with_mask",
    "note_dropout_output",
    "note_output_mask",
]

aten = torch.ops.aten


class MaskedActivationFunction(torch.autograd.Function):
    """Activations whose derivative takes two values, kept as a 1-bit mask.

    ``kind`` is one of ``relu``, ``leaky_relu`` (``param`` = slope), ``hardtanh``
    (``param`` = (min, max)); the backward matches torch's own, kink conventions included.
    """

    @staticmethod
    def forward(ctx, x, kind, param, inplace, layer):
        if kind == "relu":
            out = torch.relu_(x) if inplace else torch.relu(x)
            # as torch's threshold_backward: NaN passes the gradient
            packed = ops.relu_mask(out)
        elif kind == "leaky_relu":
            packed = ops.pack_mask(x > 0)  # (before an in-place forward)
            out = torch.nn.functional.leaky_relu(x, param, inplace=inplace)
        else:
            lo, hi = param
            packed = ops.pack_mask(~((x <= lo) | (x >= hi)))
            out = torch.nn.functional.hardtanh(x, lo, hi, inplace=inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.kind, ctx.param, ctx.shape = kind, param, x.shape
        stash(ctx, layer, [(packed, IDENTITY)])
        ctx.act_mask = packed  # read back by the module: see note_output_mask
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = unstash(ctx)
        if ctx.kind == "leaky_relu":
            mask = ops.unpack_mask(packed, ctx.shape)
            return torch.where(mask, grad, grad * ctx.param), None, None, None, None
        # where(mask, grad, 0) read straight from the bits (contiguous, as grad mostly is)
        if torch.is_grad_enabled():  # a create_graph backward: differentiable ops
            return torch.where(ops.unpack_mask(packed, ctx.shape), grad, 0), None, None, None, None
        return ops.apply_mask(grad, packed), None, None, None, None


def note_dropout_output(out: torch.Tensor) -> torch.Tensor:
    """After ``apply`` of :class:`DropoutFunction`: see :func:`actcore.layers.stash.note_output`."""
    return note_output(out)


def note_output_mask(out: torch.Tensor) -> torch.Tensor:
    """Record that a ReLU output's nonzeros are its 1-bit mask's, for the next layer.

    Called after ``apply`` returns: autograd bumps an in-place output's version once
    more after ``forward``, and the record must match the version the next layer sees.
    """
    node = out.grad_fn
    packed = getattr(node, "act_mask", None)
    if packed is not None:
        note_mask(out, packed)
    return out


def dropout_with_mask(
    x: torch.Tensor, p: float, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.dropout(x, p, training=True, inplace)`` (same random stream, same result) and its
    keep mask (bool)."""
    if x.device.type in ("cuda", "xpu") and x.numel() > 0:
        out, mask = aten.native_dropout(x, p, True)  # what F.dropout runs there
        return (x.copy_(out) if inplace else out), mask
    # F.dropout on CPU: x * (bernoulli(1 - p) / (1 - p))
    noise = torch.empty_like(x).bernoulli_(1 - p)
    mask = noise.bool()
    noise.div_(1 - p)
    return (x.mul_(noise) if inplace else x * noise), mask


def dropout_backward(grad: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The gradient through dropout with keep ``mask`` (also: what it makes of a tensor)."""
    if grad.device.type in ("cuda", "xpu"):
        return aten.native_dropout_backward(grad, mask, 1.0 / (1 - p))
    return grad * mask.to(grad.dtype).div_(1 - p)


class DropoutFunction(torch.autograd.Function):
    """Dropout with its mask at 1 bit; same random stream and output as ``F.dropout``."""

    @staticmethod
    def forward(ctx, x, p, inplace, layer):
        ctx.p, ctx.shape = p, x.shape
        out, mask = dropout_with_mask(x, p, inplace)
        if inplace:
            ctx.mark_dirty(x)
        packed = ops.pack_mask(mask)
        stash(ctx, layer, [(packed, IDENTITY)])
        part = None if inplace else source_part(x)
        if part is not None:  # a later save of out rebuilds it from x's packing and the mask
            shape, scale = x.shape, 1.0 / (1.0 - p)

            def dropped(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                return x * ops.unpack_mask(mask, shape).to(x.dtype) * scale

            derive_output(ctx, dropped, [part, (IDENTITY, (packed,), None)], affine=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = unstash(ctx)
        mask = ops.unpack_mask(packed, ctx.shape)
        return dropout_backward(grad, mask, ctx.p), None, None, None
