"""Cross-entropy that keeps neither the logits nor the log-probabilities.

``F.cross_entropy`` keeps its ``log_softmax`` output for backward: as large as the logits
(tokens x vocabulary), and exact (its backward exponentiates it). Inside a converted
model's forward, :class:`CrossEntropyFunction` computes the very same loss and keeps

* when the logits are the output of a Q-layer linear (a language model's head, seen
  through dtype casts, reshapes and selections of rows such as ``logits[..., :-1, :]``,
  which are replayed on the head's input in backward): that linear's input (tokens x
  hidden, exact) and weight, from which backward recomputes the logits bitwise, so the
  gradient is exact. The head is
  then marked (``act_feeds_loss``): from its next call on it keeps that same input tensor
  for its weight gradient instead of a compressed copy (no extra bytes: the loss holds the
  tensor anyway), so the head's weight gradient is exact too;
* the logits themselves, exact, when they are the output of a Q-layer linear narrower than
  its input (a classifier over few classes), whose input is not held for the loss: they
  cost less than that input would, and the gradient is exact;
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

from ..compressors import IDENTITY, Quantize
from ..memory import note_held
from .stash import records, stash, unstash

__all__ = [
    "LOGIT_BITS",
    "ROW_FUNCS",
    "CrossEntropyFunction",
    "is_narrow_head_output",
    "linear_source",
    "mark_loss_head",
    "note_cast",
    "note_linear_output",
    "note_rows",
]

LOGIT_BITS = 8
"""Bits of the logits a cross-entropy keeps when it cannot recompute them."""

_SOURCE = "linear source"


def note_linear_output(
    out: torch.Tensor, x: torch.Tensor, weight: Any, bias: Any, layer: Any = None
) -> None:
    """Record that ``out == F.linear(x, weight, bias)``, computed by ``layer`` (held weakly).

    When ``out`` is at least as wide as ``x`` (a language model's head: tokens x vocabulary
    from tokens x hidden), ``x`` is held as long as ``out`` lives (the record goes with
    ``out``): a head's input is often a temporary (``head(norm(h))``) that the loss could
    otherwise not find, and it costs no more than the logits, alive anyway. A narrower
    output (a classifier over few classes) holds ``x`` weakly: keeping it would cost more
    than the logits themselves, beyond what the backward holds, for as long as the caller
    keeps the output; a loss then recomputes from ``x`` only while something else holds it.
    """
    layer_ref = None if layer is None else weakref.ref(layer)
    strong = bool(out.dim() and x.dim() and out.shape[-1] >= x.shape[-1])
    held: Any = x if strong else weakref.ref(x)
    records().setdefault(out)[_SOURCE] = (held, x._version, weight, bias, layer_ref, ())
    if strong:  # held as long as ``out`` lives: the memory trackers count it while ``out``
        note_held(x, out)  # is alive (a saved ``out`` keeps it; a consumed one frees it)


def note_cast(out: torch.Tensor, source: torch.Tensor) -> None:
    """Record that ``out`` is ``source`` cast to another dtype (a linear source carries over)."""
    found = _source_record(source)
    if found is not None:
        records().setdefault(out)[_SOURCE] = found


_RESHAPES = {
    torch.Tensor.reshape,
    torch.Tensor.view,
    torch.Tensor.flatten,
    torch.reshape,
    torch.flatten,
}
ROW_FUNCS = frozenset({*_RESHAPES, torch.Tensor.__getitem__, torch.Tensor.contiguous})
"""The calls :func:`note_rows` follows."""


def note_rows(out: Any, func: Any, args: tuple, kwargs: dict) -> None:
    """After ``out = func(*args, **kwargs)`` on logits: when it selects or reshapes rows and
    keeps the class dimension (``logits[..., :-1, :]``-style indexing of the leading dims,
    ``reshape(-1, V)``, ``contiguous()``), record the same selection of the head's rows, so
    a loss on ``out`` still recomputes its logits from the head's input."""
    src = args[0] if args else None
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return
    if out.dim() == 0 or src.dim() == 0 or out.shape[-1] != src.shape[-1] or out is src:
        return
    found = _source_record(src)
    if found is None:
        return
    if func is torch.Tensor.contiguous:
        step: tuple = ()
    elif func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
        index = _leading_index(args[1], src.dim())
        if index is None:
            return  # the class dimension indexed, or ``None``/masks: not followed
        step = (("index", index),)
    elif func in _RESHAPES:
        step = (("reshape", tuple(out.shape[:-1])),)
    else:
        return
    x, version, weight, bias, layer_ref, steps = found
    records().setdefault(out)[_SOURCE] = (x, version, weight, bias, layer_ref, steps + step)


def _leading_index(index: Any, dim: int) -> tuple | None:
    """``index`` as a tuple over the leading dims only (``...`` spelled out, a trailing full
    slice of the class dimension dropped), or None when it is anything else."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (dim - len(index) + 1) + index[at + 1 :]
    if len(index) == dim and index[-1] == slice(None):
        index = index[:-1]
    plain = all(isinstance(i, (int, slice)) or _is_index_tensor(i) for i in index)
    return index if plain and len(index) < dim else None


def _is_index_tensor(i: Any) -> bool:
    return isinstance(i, torch.Tensor) and not i.is_floating_point() and i.dtype != torch.bool


def _replay(x: torch.Tensor, steps: tuple) -> torch.Tensor:
    """The head's input rows that the logits' recorded selections kept."""
    for kind, arg in steps:
        x = x[arg] if kind == "index" else x.reshape(*arg, x.shape[-1])
    return x


def _source_record(t: torch.Tensor) -> tuple | None:
    record = records().get(t)
    if record is not None and _SOURCE in record:
        return record[_SOURCE]
    base = t._base
    record = None if base is None else records().get(base)
    if record is None or _SOURCE not in record:
        return None
    pure_reshape = (
        base.is_contiguous()
        and t.is_contiguous()
        and t.storage_offset() == base.storage_offset()
        and t.numel() == base.numel()
        and t.shape[-1] == base.shape[-1]
    )
    if not pure_reshape:
        return None  # a view that selects rows or cuts the class dimension, not recorded
    x, version, weight, bias, layer_ref, steps = record[_SOURCE]
    return x, version, weight, bias, layer_ref, (*steps, ("reshape", tuple(t.shape[:-1])))


def linear_source(logits: torch.Tensor) -> tuple[torch.Tensor, Any, Any, tuple] | None:
    """``(x, weight, bias, steps)``: ``logits`` is ``F.linear(x', weight, bias)`` reshaped
    to 2-d (possibly cast), ``x'`` the rows of ``x`` that ``steps`` select, when known and
    ``x`` is unchanged; else None."""
    found = _source_record(logits)
    if found is None:
        return None
    held, version, weight, bias, _, steps = found
    x = held() if isinstance(held, weakref.ref) else held
    if x is None or x._version != version:
        return None
    try:
        rows = _replay(x.detach(), steps)  # views, or a copy for an index tensor (dropped)
    except (IndexError, RuntimeError):
        return None
    if rows.numel() // rows.shape[-1] != logits.numel() // logits.shape[-1]:
        return None  # rows selected in a way that was not followed
    return x, weight, bias, steps


def is_narrow_head_output(logits: torch.Tensor) -> bool:
    """Whether ``logits`` are the output of a Q-layer linear narrower than its input (seen
    through casts and selections of rows; :func:`note_linear_output` holds its input
    weakly)."""
    found = _source_record(logits)
    return found is not None and isinstance(found[0], weakref.ref)


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
    def forward(ctx, logits, target, options, source, layer, exact):
        loss = F.cross_entropy(logits, target, **options)
        ctx.options, ctx.shape, ctx.dtype = options, logits.shape, logits.dtype
        if source is not None:
            x, weight, bias, ctx.steps = source
            ctx.linear = (weight, bias)
            stash(ctx, layer, [(x, IDENTITY), (target, IDENTITY)])
        else:
            ctx.linear = None
            comp = IDENTITY if exact else Quantize(LOGIT_BITS, stochastic=False)
            stash(ctx, layer, [(logits, comp), (target, IDENTITY)])
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        saved, target = unstash(ctx)
        if ctx.linear is not None:
            weight, bias = ctx.linear
            rows = _replay(saved, ctx.steps)
            logits = F.linear(rows, weight, bias).reshape(ctx.shape).to(ctx.dtype)
        else:
            logits = saved
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(leaf, target, **ctx.options)
            (found,) = torch.autograd.grad(loss, leaf, grad)
        return found, None, None, None, None, None
