"""Cheap modules and functionals recomputed in backward from a compressed input.

Two kinds go this way:

* normalization modules written in Python (transformers' ``*RMSNorm``, ``T5LayerNorm``,
  Gemma's ``(1 + w)`` variant...): their forward is a chain of elementwise ops (``pow``,
  ``mean``, ``rsqrt``, products, dtype casts) that the saved-tensor hooks would each keep,
  the per-row ``rsqrt`` included. Their input is kept normalized by its own root mean
  square per row, compressed at the level's row-norm bits, next to that root mean square exact;
* smooth activations (``F.gelu``, ``F.silu``, ``torch.tanh``... and registered activation
  modules such as transformers' ``NewGELUActivation``): their input is kept at the level's
  activation bits, its largest channels exact and outlier channels scaled apart
  (:class:`~actcore.compressors.ChannelScaled`), with ``actcore.config.keep_derivatives``
  their derivative instead (:mod:`.derivative`). Rebuilding ``f(q(x))`` and ``f'(q(x))`` is
  biased in principle (``E[f(q(x))] != f(x)`` for a curved ``f``); with outliers kept apart
  that bias is small: on a linear-GELU-linear block at 2 bits the mean of 1024 gradients
  sits about 1% of the gradient from the true one (6% of one step's noise), where keeping
  the derivative is unbiased but its next linear's own 2-bit copy of the output carries
  4x the noise.

The forward is the module's (or functional's) own, once, so the output is bitwise the
same. Backward rebuilds the input and differentiates that same forward again: whatever
formula it computes, the gradient is its exact gradient at the restored input, for the
cost of one more (cheap) forward. The output is recorded as derived from the kept input
(:func:`actcore.layers.stash.derive`): the next layer, which saves it, stores nothing of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..compressors import IDENTITY
from ..config import config
from .base import ConvertedLayer
from .derivative import keep_derivative
from .forward_state import forward_state, plain_saves, replayed
from .roles import ACTIVATION, ROW_NORM
from .stash import choose, derive_output, note_output, observe, stash, unstash

__all__ = [
    "RecomputeFunction",
    "RecomputedModule",
    "recompute",
    "recomputed_class",
    "register_recomputed",
]

Derivative = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(grad, x) -> grad_x``: autograd's own formula for an activation's input gradient."""

_NORM_NAME = re.compile(r"(RMSNorm|RmsNorm|LayerNorm)$")
_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
_CLASSES: dict[type, type] = {}
_ACTIVATIONS: dict[type, Derivative | None] = {}  # class -> its input derivative, if any


class RecomputeFunction(torch.autograd.Function):
    """``forward(x)``, keeping ``x`` compressed and recomputing ``forward`` in backward.

    ``normalize``: keep ``x`` divided by its root mean square per row (last dim) and that
    scale exact (norms), else ``x`` itself (activations). ``derivative``: ``(grad, x) ->``
    the input's gradient, where the op has one reading its input only (``silu_backward``):
    backward then skips the rerun (outside autocast; the gradient is bitwise the rerun's).
    ``in_place``: the same op writing into ``x`` (an activation called with ``inplace=True``):
    ``x`` is packed first, then overwritten and returned, as autograd's own in-place op does
    with the copy of ``x`` it saves; ``forward`` (out of place) still serves the rerun.
    ``params``: tensors ``forward`` uses that may need gradients (a norm's weight).
    """

    @staticmethod
    def forward(ctx, x, forward, layer, normalize, derivative, in_place, *params):
        dtype = x.dtype
        state = forward_state(x.device)  # the rerun in backward runs under it too
        comp = choose(layer, ROW_NORM if normalize else ACTIVATION, x)
        if in_place is not None and normalize:
            raise ValueError("RecomputeFunction: in_place is for activations, not norms")
        if normalize and comp.lossy:  # the error is then relative to each row's own scale
            out = forward(x)
            rstd = x.float().square().mean(-1, keepdim=True)
            rstd = rstd.clamp_min_(torch.finfo(torch.float32).tiny).rsqrt_()
            parts = stash(ctx, layer, [(x.float() * rstd, comp), (rstd, IDENTITY)], watch=(x,))

            def output(x_hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
                with replayed(state):
                    return forward((x_hat / rstd).to(dtype))

        else:
            # packed before an in-place op overwrites x (kept exact: a copy, as autograd's
            # own in-place op keeps)
            kept = x.clone() if in_place is not None and not comp.lossy else x
            parts = stash(ctx, layer, [(kept, comp), (None, IDENTITY)])
            if in_place is not None:
                ctx.act_versions = []  # (x is this op's output now: autograd tracks it)
                out = in_place(x)
                ctx.mark_dirty(out)
            else:
                out = forward(x)

            def output(x: torch.Tensor, _: None) -> torch.Tensor:
                with replayed(state):
                    return forward(x)

        derive_output(ctx, output, parts)  # whoever saves the output refers to these
        ctx.normalized, ctx.dtype, ctx.forward = normalize and comp.lossy, dtype, forward
        ctx.params, ctx.state = params, state
        ctx.derivative = derivative if not params and state.autocast is None else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, rstd = unstash(ctx)
        if ctx.params:
            observe(ctx, grad, norm=True)
        if ctx.normalized:
            x = (x / rstd).to(ctx.dtype)
        if ctx.derivative is not None:  # (what autograd's formula for the op computes)
            return ctx.derivative(grad, x), None, None, None, None, None
        needs = [ctx.needs_input_grad[0], *ctx.needs_input_grad[6:]]
        x = x.detach().requires_grad_(needs[0])
        inputs = [x, *ctx.params]
        wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
        with torch.enable_grad(), plain_saves(), replayed(ctx.state):
            out = ctx.forward(x)
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        grads = [next(found) if need else None for need in needs]
        return grads[0], None, None, None, None, None, *grads[1:]


def recompute(
    x: torch.Tensor,
    forward: Callable[[torch.Tensor], torch.Tensor],
    layer: Any,
    derivative: Derivative | None = None,
    in_place: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``forward(x)`` for an elementwise activation, recomputed in backward (module doc);
    ``derivative``, ``in_place`` (the op writing into ``x``, which it then returns): see
    :class:`RecomputeFunction`."""
    return note_output(RecomputeFunction.apply(x, forward, layer, False, derivative, in_place))


class RecomputedModule(ConvertedLayer):
    """Mixin of the Q form of a cheap module recomputed in backward (see the module doc)."""

    act_normalize: bool = False
    act_adaptive_bits = False  # the level's row-norm / activation bits
    act_source_class: type = nn.Module  # the class it was made from

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = list(self.parameters())  # type: ignore[attr-defined]
        if not self._compresses(x, *params):  # type: ignore[attr-defined]
            return self.plain_forward(x)
        if not self.act_normalize and not params and config.keep_derivatives:
            return keep_derivative(x, self.plain_forward, self)  # unbiased: see .derivative
        derivative = _ACTIVATIONS.get(self.act_source_class)
        out = RecomputeFunction.apply(
            x, self.plain_forward, self, self.act_normalize, derivative, None, *params
        )
        return note_output(out)


def register_recomputed(cls: type[nn.Module], derivative: Derivative | None = None) -> None:
    """Make :func:`actcore.convert` give modules of exactly this elementwise activation class
    the recomputed form (their input kept at the level's activation bits).

    ``derivative``: ``(grad, x) -> grad_x``, the very op autograd's backward of the class's
    forward calls (transformers' ``SiLUActivation``, ``F.silu``: ``aten.silu_backward``);
    backward then calls it on the restored input instead of rerunning the forward to
    differentiate it (outside autocast). Without it, backward reruns the forward."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_recomputed takes an nn.Module class, got {cls!r}")
    if derivative is not None and not callable(derivative):
        raise TypeError(f"derivative must be callable (grad, x) -> grad_x, got {derivative!r}")
    _ACTIVATIONS[cls] = derivative


def recomputed_class(module: nn.Module) -> type[nn.Module] | None:
    """The recomputed Q form of ``module``'s class, or None: for Python-written norms (a leaf
    named ``*RMSNorm``/``*RmsNorm``/``*LayerNorm``, not one of torch's norms, with at most
    ``weight`` and ``bias`` as parameters) and registered activation classes."""
    cls = type(module)
    if cls in _CLASSES.values():
        return cls
    if cls in _ACTIVATIONS:
        normalize = False
    elif _NORM_NAME.search(cls.__name__) and not isinstance(module, _TORCH_NORMS):
        if any(True for _ in module.children()):
            return None
        if not {n for n, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}:
            return None
        normalize = True
    else:
        return None
    found = _CLASSES.get(cls)
    if found is None:
        from .base import QLayer

        # a module-level name, so converted models pickle (the source module in it keeps
        # two libraries' classes of one name apart)
        name = "Q_" + re.sub(r"\W", "_", f"{cls.__module__}.{cls.__qualname__}")
        attrs = {
            "__module__": __name__,
            "__qualname__": name,
            "act_normalize": normalize,
            "act_recompute_output": normalize,  # (a norm: see QLayer.__call__)
            "act_source_class": cls,
        }
        found = _CLASSES[cls] = type(name, (RecomputedModule, QLayer, cls), attrs)
        globals()[name] = found
    return found
