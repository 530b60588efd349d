"""Autograd functions of the conv, transposed conv and linear Q-layers.

Each forward computes exactly what the torch layer computes (the same aten op) and saves
its input through :func:`actcore.layers.stash.stash`; backward runs the public aten backward op
on the restored input (in micro-batches when the layer's level asks for them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .double_backward import guard_input
from .input_meta import InputMeta
from .roles import CONV
from .stash import IDENTITY, layer_spec, observe, stash, unstash

__all__ = [
    "ConvFunction",
    "LinearFunction",
    "own_output",
]

aten = torch.ops.aten


def own_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor of its own, not a view (same storage, same values).

    A custom autograd function's output that is a view (``F.linear`` of a 3-D input returns
    ``addmm(...).view(...)``) cannot be modified in place afterwards; the layer it replaces
    returns one that can, and models do (``nn.ReLU(inplace=True)`` after a linear).
    """
    if out._base is None:
        return out
    return aten._unsafe_view(out, out.shape)


def _micro_batches(layer: Any, x: torch.Tensor) -> int:
    return max(1, min(layer_spec(layer).micro_batches, x.shape[0] if x.dim() else 1))


def _keep_input_and_weight(
    ctx: Any, layer: Any, x: torch.Tensor, weight: torch.Tensor, x_link: Any
) -> None:
    """What conv and linear keep: the input, compressed (nothing when the weight needs no
    gradient), and the weight."""
    stash(ctx, layer, [(x if weight.requires_grad else None, CONV), (weight, IDENTITY)])
    ctx.x_link = x_link


def _restore_input_and_weight(
    ctx: Any, grad: torch.Tensor, linear: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The kept input and weight, after handing the output gradient to the layer's scheme
    (a linear's with its restored input, a convolution's with its kernel size)."""
    x, weight = unstash(ctx)
    if linear:
        observe(ctx, grad, channel_dim=-1, restored=x)
    else:
        observe(ctx, grad, kernel=math.prod(weight.shape[2:]))
    return guard_input(ctx, x, weight, grad), weight


class ConvFunction(torch.autograd.Function):
    """Convolution and transposed convolution (aten.convolution / convolution_backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, args, x_link=None):
        stride, padding, dilation, transposed, output_padding, groups = args
        out = own_output(
            aten.convolution(
                x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
            )
        )
        ctx.layer, ctx.args = layer, args
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.input_meta = InputMeta(x)
        _keep_input_and_weight(ctx, layer, x, weight, x_link)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = _restore_input_and_weight(ctx, grad, linear=False)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_for_shape = x if x is not None else ctx.input_meta.tensor()
        chunks = _micro_batches(ctx.layer, x_for_shape) if need_w and x is not None else 1
        if chunks == 1:  # the op itself: no split, no cat or sum of one part
            gx, gw, gb = aten.convolution_backward(
                grad, x_for_shape, weight, ctx.bias_sizes, *ctx.args, [need_x, need_w, need_b]
            )
            return gx, gw, gb, None, None, None
        results = []
        for g_part, x_part in zip(grad.chunk(chunks), x_for_shape.chunk(chunks), strict=True):
            results.append(
                aten.convolution_backward(
                    g_part, x_part, weight, ctx.bias_sizes, *ctx.args, [need_x, need_w, need_b]
                )
            )
        gx = torch.cat([r[0] for r in results]) if need_x else None
        gw = sum(r[1] for r in results) if need_w else None
        gb = sum(r[2] for r in results) if need_b else None
        return gx, gw, gb, None, None, None


class LinearFunction(torch.autograd.Function):
    """``F.linear`` with a compressed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, x_link=None):
        out = own_output(torch.nn.functional.linear(x, weight, bias))
        _keep_input_and_weight(ctx, layer, x, weight, x_link)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = _restore_input_and_weight(ctx, grad, linear=True)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = grad.matmul(weight) if need_x else None
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        gb = g2.sum(0) if need_b else None
        return gx, gw, gb, None, None
