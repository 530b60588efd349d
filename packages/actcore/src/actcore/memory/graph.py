"""Autograd-graph helpers of :mod:`actcore.memory`: node sequence numbers, the nodes behind
an output, and whether Dynamo is tracing (private to the package)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .storage import iter_tensors

__all__: list[str] = []

NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad and other graph leaves

_SEQ_LEAF: list[Tensor] = []


def next_seq() -> int | None:
    """Sequence number of a fresh autograd node: every later node gets a larger one."""
    if not _SEQ_LEAF:
        _SEQ_LEAF.append(torch.empty(0, requires_grad=True))
    leaf = _SEQ_LEAF[0]
    with torch.enable_grad():
        node = leaf.view_as(leaf).grad_fn
    return None if node is None else node._sequence_nr()


def compiling_now() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn is not None and fn())


def grad_fns(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Autograd nodes behind the tensors of a (nested) output."""
    for t in iter_tensors(obj, depth):
        if t.grad_fn is not None:
            yield t.grad_fn
