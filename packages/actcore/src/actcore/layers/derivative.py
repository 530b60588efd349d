"""Smooth elementwise activations that keep their derivative, not their input.

Backward of ``y = f(x)`` needs ``f'(x)``. Keeping ``x`` rounded and evaluating ``f'`` there
gives a *biased* gradient: ``E[f'(q(x))] != f'(x)`` for any curved ``f`` (GELU, SiLU, tanh,
sigmoid...), and so does rebuilding the next layer's input as ``f(q(x))``. The bias does
not average out over steps, and one outlier channel (which sets a coarse rounding step for
its whole group) makes it large: 13-83% on a linear after GELU or tanh.

So the activation keeps ``d = f'(x)`` itself, stochastically rounded at the level's
activation bits. The input gradient ``grad * q(d)`` is then linear in the rounded tensor,
hence unbiased, and ``d`` is bounded (GELU's lies in [-0.17, 1.13], sigmoid's in
(0, 0.25]), so an outlier in ``x`` does not coarsen its neighbours' steps. The output is not
rebuilt from anything: whoever saves it (the next linear) packs it on its own, an unbiased
rounding of the exact output.

``d`` is computed in forward by differentiating the very ``f`` of the forward (one
elementwise backward), so any activation works, and the output is ``f(x)`` bitwise.

Used where ``actcore.config.keep_derivatives`` is set (routed functionals and registered
activation modules); by default activations are recomputed (:mod:`.recompute`), which keeps
fewer bytes and one step's gradient less noisy, with a small bias (measured there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..saved_tensors.op_mode import outside_function_modes
from .forward_state import plain_saves
from .roles import DERIVATIVE
from .stash import stash, unstash

__all__ = ["DerivativeFunction", "keep_derivative"]


class DerivativeFunction(torch.autograd.Function):
    """``forward(x)`` for an elementwise ``forward``, keeping its derivative at ``x`` (at
    the level's activation bits) for backward (see the module doc)."""

    @staticmethod
    def forward(ctx, x, forward, layer):
        with torch.enable_grad(), plain_saves(), outside_function_modes():
            leaf = x.detach().requires_grad_()
            out = forward(leaf)
            (derivative,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
        stash(ctx, layer, [(derivative, DERIVATIVE)], watch=(x,))
        return out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (derivative,) = unstash(ctx)
        return grad * derivative.to(grad.dtype), None, None


def keep_derivative(
    x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], layer: Any
) -> torch.Tensor:
    """``forward(x)`` for an elementwise activation, keeping ``forward'(x)`` (module doc)."""
    return DerivativeFunction.apply(x, forward, layer)
