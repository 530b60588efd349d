"""DropIT's layer math: one description per layer family, one autograd Function for all.

The Function computes the layer's exact output and saves the weight and the min-k of the
input; its backward computes the input and bias gradients exactly and the weight gradient
from the restored (sparsified) input.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .mink import Kept, drop_mink

__all__ = [
    "ConvOp",
    "DropITFunction",
    "LinearOp",
    "autocast_dtype",
]


@dataclasses.dataclass(frozen=True)
class LinearOp:
    """``y = x W^T + b`` (nn.Linear, weight (out, in)) or ``x W + b`` (HF Conv1D, (in, out))."""

    weight_in_out: bool = False

    def rows(self, x: Tensor) -> int:
        return x.shape[0] if x.dim() >= 2 else 1

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.weight_in_out:
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.mm(weight) if bias is None else torch.addmm(bias, x2, weight)
        return y.view(*x.shape[:-1], weight.shape[-1])

    def backward(
        self, grad: Tensor, x: Tensor | None, x_shape: torch.Size, weight: Tensor, needs: Any
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if needs[0]:
            gx = g2.mm(weight.t() if self.weight_in_out else weight).view(x_shape)
        if needs[1]:
            assert x is not None
            x2 = x.reshape(-1, x.shape[-1])
            gw = x2.t().mm(g2) if self.weight_in_out else g2.t().mm(x2)
        if needs[2]:
            gb = g2.sum(0)
        return gx, gw, gb


@dataclasses.dataclass(frozen=True)
class ConvOp:
    """Batched ``aten.convolution`` with integer padding (any number of spatial dims)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def rows(self, x: Tensor) -> int:
        return x.shape[0]

    def _args(self) -> tuple[Any, ...]:
        zeros = [0] * len(self.stride)
        return list(self.stride), list(self.padding), list(self.dilation), False, zeros

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.aten.convolution(x, weight, bias, *self._args(), self.groups)

    def backward(
        self, grad: Tensor, x: Tensor | None, x_shape: torch.Size, weight: Tensor, needs: Any
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if x is None:  # input gradient only: it depends on the input's shape, not its values
            x = grad.new_zeros(()).expand(x_shape)
        bias_sizes = [weight.shape[0]] if needs[2] else None
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, weight, bias_sizes, *self._args(), self.groups, list(needs)
        )
        return gx, gw, gb


class DropITFunction(torch.autograd.Function):
    """The layer's exact output; saves the weight and min-k of the input (for the weight grad)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        op: LinearOp | ConvOp,
        gamma: float,
        per_sample: bool,
    ) -> Tensor:
        out = op.forward(x, weight, bias)
        ctx.op, ctx.x_shape, ctx.layout = op, x.shape, None
        kept: tuple[Tensor, ...] = ()
        if ctx.needs_input_grad[1]:
            rows = op.rows(x) if per_sample and x.numel() else 1
            dropped = drop_mink(x, gamma, rows=rows)
            ctx.layout, kept = dropped.layout, dropped.tensors()
        ctx.save_for_backward(weight, *kept)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, *kept = ctx.saved_tensors
        x = Kept.from_tensors(kept, ctx.layout).restore() if ctx.layout is not None else None
        needs = ctx.needs_input_grad[:3]
        gx, gw, gb = ctx.op.backward(grad, x, ctx.x_shape, weight, needs)
        return gx, gw, gb, None, None, None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        pass
    return None
