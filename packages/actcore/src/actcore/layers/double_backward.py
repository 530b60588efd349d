"""Double backward through the Q-layers' autograd functions.

A backward run with ``create_graph=True`` builds a graph of itself for a second derivative
(gradient penalties). Per op (see the README's "Works with"):
* exact tensors (masks, max-pool offsets, inputs kept at full precision, weights): the
  backward is made of differentiable ops on them, so the second derivative is exact;
* normalization layers, SyncBatchNorm, with a compressed input: their input gradient
  depends on the input itself, which is gone; a create_graph backward through them raises
  at once, naming the layer;
* conv/linear with a compressed input: the input gradient (``grad @ W``) is exact; only the
  weight gradient uses the restored input, whose own derivative is unavailable: it is
  wired to raise, naming the layer, if (and only if) a second derivative needs it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "LOST_INPUT",
    "guard_input",
    "layer_name",
    "link",
    "no_second_derivative",
    "refuse_double_backward",
]


def link(x: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor on ``x``'s autograd graph that holds none of ``x``'s memory.

    Passed to an autograd function beside ``x``, it lets a later double backward reach
    ``x``'s history exactly where the second derivative through the restored ``x`` belongs.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return None
    # no elements: no memory (an empty copy allocates nothing and keeps nothing of x's
    # storage), yet on x's graph; one op
    if x.dim():
        return torch.ops.aten.narrow_copy(x, 0, 0, 0)
    return x.reshape(1)[:0].clone()


class _Unavailable(torch.autograd.Function):
    """Identity on ``t``, attached to ``anchors``; its backward raises ``message``."""

    @staticmethod
    def forward(ctx, t, message, *anchors):
        ctx.message = message
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


def layer_name(layer: Any) -> str:
    name = getattr(layer, "act_name", None)
    kind = type(layer).__name__
    return kind if name is None else f"{kind} {name or '<root>'!r}"


def no_second_derivative(
    t: torch.Tensor, what: str, anchors: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    """``t`` (restored from a lossy packing) such that differentiating through it raises."""
    live = [a for a in anchors if a is not None and a.requires_grad]
    if not live:
        return t
    message = (
        f"double backward (create_graph=True) through {what}: the tensor it saved for backward "
        "is stored compressed, so its second derivative is not available. Keep this layer "
        "exact (convert(..., exclude=[...]) or level L0), or compute the penalty's graph "
        "outside the converted model."
    )
    return _Unavailable.apply(t, message, *live)


LOST_INPUT = (
    "its input gradient depends on its input, which is stored compressed, so the second "
    "derivative is not available (it would be silently wrong)"
)


def refuse_double_backward(ctx: Any, what: str, why: str = LOST_INPUT) -> None:
    """Raise now in a create_graph backward of ``what``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"double backward (create_graph=True) through {what}: {why}. Keep this layer "
            "as torch's own (convert(..., exclude=[...])), or compute the penalty's graph "
            "outside the converted model."
        )


def _lossy(ctx: Any, item: int) -> bool:
    """Whether ``stash``'s ``item``-th tensor of ``ctx`` was packed by a lossy compressor."""
    comp = ctx.act_plan[item][1]
    return comp is not None and comp.lossy


def guard_input(
    ctx: Any,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    grad: torch.Tensor,
    lossy: bool | None = None,
) -> torch.Tensor | None:
    """In a create_graph backward, the restored input of a conv/linear whose input required
    grad: differentiating through it raises (its derivative is the lost exact input's).

    ``lossy``: whether ``x`` differs from the input (default: its ``stash`` compressor says).
    """
    if x is None or not torch.is_grad_enabled() or not ctx.needs_input_grad[0]:
        return x
    if not (_lossy(ctx, 0) if lossy is None else lossy):
        return x
    x_link = getattr(ctx, "x_link", None)
    anchors = (x_link,) if x_link is not None else (weight, grad)
    return no_second_derivative(x, layer_name(ctx.act_layer), anchors)
