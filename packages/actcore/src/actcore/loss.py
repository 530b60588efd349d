"""Cross-entropy that keeps neither the logits nor the log-probabilities.

``F.cross_entropy`` keeps its ``log_softmax`` output for backward: as large as the logits
(tokens x vocabulary), and exact (its backward exponentiates it). Inside a converted
model's forward, :class:`CrossEntropyFunction` computes the very same loss and keeps

* when the logits are the output of a Q-layer linear (a language model's head, seen
  through views and dtype casts): that linear's input (tokens x hidden, exact) and weight,
  from which backward recomputes the logits bitwise, so the gradient is exact. The head is
  then marked (``act_feeds_loss``): from its next call on it keeps that same input tensor
  for its weight gradient instead of a compressed copy (no extra bytes: the loss holds the
  tensor anyway), so the head's weight gradient is exact too;
* otherwise: the logits compressed at :data:`LOGIT_BITS` bits, backward on the restored
  logits (an approximation, like any compressed activation).

Backward runs torch's own cross-entropy again on the recomputed logits, so every option
(``weight``, ``ignore_index``, ``reduction``, ``label_smoothing``) behaves as torch's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import engine
from .compressors import IDENTITY, Quantize

__all__ = [
    "LOGIT_BITS",
    "CrossEntropyFunction",
    "linear_source",
    "mark_loss_head",
    "note_linear_output",
]

LOGIT_BITS = 8
"""Bits of the logits a cross-entropy keeps when it cannot recompute them."""

_SOURCE = "linear source"


def note_linear_output(
    out: torch.Tensor, x: torch.Tensor, weight: Any, bias: Any, layer: Any = None
) -> None:
    """Record that ``out == F.linear(x, weight, bias)``, computed by ``layer`` (held weakly).

    ``x`` is held as long as ``out`` lives (the record goes with ``out``): a head's input is
    often a temporary (``head(norm(h))``) that the loss could otherwise not find. It costs
    tokens x hidden while the tokens x vocabulary logits are alive anyway.
    """
    layer_ref = None if layer is None else weakref.ref(layer)
    engine.records().setdefault(out)[_SOURCE] = (x, x._version, weight, bias, layer_ref)


def note_cast(out: torch.Tensor, source: torch.Tensor) -> None:
    """Record that ``out`` is ``source`` cast to another dtype (a linear source carries over)."""
    found = _source_record(source)
    if found is not None:
        engine.records().setdefault(out)[_SOURCE] = (*found, source.dtype)


def _source_record(t: torch.Tensor) -> tuple | None:
    for candidate in (t, t._base):
        if candidate is None:
            continue
        record = engine.records().get(candidate)
        if record is not None and _SOURCE in record:
            if candidate is not t and t.shape[-1] != candidate.shape[-1]:
                return None  # a view that cuts the class dimension: not the linear's rows
            return record[_SOURCE][:5]
    return None


def linear_source(logits: torch.Tensor) -> tuple[torch.Tensor, Any, Any] | None:
    """``(x, weight, bias)`` such that ``logits`` is ``F.linear(x, weight, bias)`` reshaped
    to 2-d (possibly cast), when known and ``x`` is unchanged; else None."""
    found = _source_record(logits)
    if found is None:
        return None
    x, version, weight, bias, _ = found
    if x._version != version:
        return None
    if x.numel() // x.shape[-1] != logits.numel() // logits.shape[-1]:
        return None  # the logits are a slice of the head's rows
    return x, weight, bias


def mark_loss_head(logits: torch.Tensor) -> None:
    """Mark the Q-layer linear that computed ``logits`` as feeding a recomputing loss
    (``act_feeds_loss``; see the module docstring)."""
    found = _source_record(logits)
    layer = None if found is None or found[4] is None else found[4]()
    if layer is not None:
        layer.act_feeds_loss = True


class CrossEntropyFunction(torch.autograd.Function):
    """``F.cross_entropy(logits, target, **options)`` keeping what recomputes the logits."""

    @staticmethod
    def forward(ctx, logits, target, options, source, layer):
        loss = F.cross_entropy(logits, target, **options)
        ctx.options, ctx.shape, ctx.dtype = options, logits.shape, logits.dtype
        if source is not None:
            x, weight, bias = source
            ctx.linear = (weight, bias)
            engine.stash(ctx, layer, [(x, IDENTITY), (target, IDENTITY)])
        else:
            ctx.linear = None
            comp = Quantize(LOGIT_BITS, stochastic=False)
            engine.stash(ctx, layer, [(logits, comp), (target, IDENTITY)])
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        saved, target = engine.unstash(ctx)
        if ctx.linear is not None:
            weight, bias = ctx.linear
            logits = F.linear(saved, weight, bias).reshape(ctx.shape).to(ctx.dtype)
        else:
            logits = saved
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(leaf, target, **ctx.options)
            (found,) = torch.autograd.grad(loss, leaf, grad)
        return found, None, None, None, None
