"""Normalization modules written in Python (transformers' ``*RMSNorm``, ``T5LayerNorm``,
Gemma's ``(1 + w)`` variant...): recomputed in backward from a compressed input.

Their forward is a chain of elementwise ops (``pow``, ``mean``, ``rsqrt``, products, dtype
casts) that the saved-tensor hooks would each keep, the per-row ``rsqrt`` included. The Q
form runs the module's own forward once (same output, bitwise) and keeps only its input,
normalized by its own root mean square per row and compressed at the level's norm bits,
next to that root mean square exact; backward rebuilds the input and differentiates the
module's own forward again. Whatever formula the module computes, the gradient is its exact
gradient at the restored input, at the cost of one more (cheap) forward of the norm.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..compressors import IDENTITY
from ..engine import NORM, choose, derive_output, note_output, observe, stash, unstash

__all__ = ["RecomputedNorm", "recomputed_norm_class"]

_NAME = re.compile(r"(RMSNorm|RmsNorm|LayerNorm)$")
_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
_CLASSES: dict[type, type] = {}


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class NormRecomputeFunction(torch.autograd.Function):
    """``layer``'s own forward; keeps its input compressed and recomputes it in backward."""

    @staticmethod
    def forward(ctx, x, layer, *params):
        out = layer.plain_forward(x)
        rstd = x.float().square().mean(-1, keepdim=True)
        rstd = rstd.clamp_min_(torch.finfo(torch.float32).tiny).rsqrt_()
        comp = choose(layer, NORM, x)
        dtype = x.dtype
        if comp.lossy:  # the error is then relative to each row's own scale
            parts = stash(ctx, layer, [(x.float() * rstd, comp), (rstd, IDENTITY)])

            def output(x_hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
                return layer.plain_forward((x_hat / rstd).to(dtype))

        else:
            parts = stash(ctx, layer, [(x, comp), (None, IDENTITY)])

            def output(x: torch.Tensor, _: None) -> torch.Tensor:
                return layer.plain_forward(x)

        derive_output(ctx, output, parts)  # whoever saves the output refers to these
        ctx.normalized, ctx.dtype, ctx.layer = comp.lossy, dtype, layer
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, rstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        if ctx.normalized:
            x = (x / rstd).to(ctx.dtype)
        params = list(ctx.layer.parameters())
        needs = ctx.needs_input_grad
        x = x.detach().requires_grad_(needs[0])
        wanted = [t for t, need in zip([x, *params], [needs[0], *needs[2:]], strict=True) if need]
        hooks = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
        with torch.enable_grad(), hooks:
            out = ctx.layer.plain_forward(x)
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        grads = [next(found) if need else None for need in [needs[0], *needs[2:]]]
        return grads[0], None, *grads[1:]


class RecomputedNorm:
    """Mixin of the Q form of a Python-written normalization module (see the module doc)."""

    act_level: str | None = None
    act_scheme: Any = None

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = list(self.parameters())  # type: ignore[attr-defined]
        if not self._compresses(x, *params):  # type: ignore[attr-defined]
            return self.plain_forward(x)
        return note_output(NormRecomputeFunction.apply(x, self, *params))


def recomputed_norm_class(module: nn.Module) -> type[nn.Module] | None:
    """The Q form of ``module``'s class if it is a Python-written normalization module: a
    leaf named ``*RMSNorm``/``*RmsNorm``/``*LayerNorm``, not one of torch's norms (those
    have Q-layers), with at most ``weight`` and ``bias`` as parameters; else None."""
    cls = type(module)
    if cls in _CLASSES.values():
        return cls
    if not _NAME.search(cls.__name__) or isinstance(module, _TORCH_NORMS):
        return None
    if any(True for _ in module.children()):
        return None
    if not {n for n, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}:
        return None
    found = _CLASSES.get(cls)
    if found is None:
        from .modules import QLayer

        # a module-level name, so converted models pickle (the source module in it keeps
        # two libraries' classes of one name apart)
        name = "Q_" + re.sub(r"\W", "_", f"{cls.__module__}.{cls.__qualname__}")
        found = _CLASSES[cls] = type(
            name, (RecomputedNorm, QLayer, cls), {"__module__": __name__, "__qualname__": name}
        )
        globals()[name] = found
    return found
