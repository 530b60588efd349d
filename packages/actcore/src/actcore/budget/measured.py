"""Measurements a memory plan takes once per model and shape of its example inputs (the
gradient errors of :mod:`.errors`, the step times of :mod:`.costs`), kept while the model
lives, so that planning the same model for another budget measures nothing again."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["forget", "input_signature", "measured_once"]

T = TypeVar("T")

_KEPT: weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def measured_once(
    kind: str, model: nn.Module, example_inputs: Any, key: Hashable, measure: Callable[[], T]
) -> T:
    """``measure()``, or what it gave before for this ``kind``, ``model``, ``key`` and shape
    of ``example_inputs`` (a callable: its identity, held while the result is kept)."""
    full = (kind, input_signature(example_inputs), key)
    kept = _KEPT.setdefault(model, {})
    if full not in kept:
        pinned = example_inputs if callable(example_inputs) else None
        kept[full] = (measure(), pinned)
    return kept[full][0]


def forget(kind: str, model: nn.Module) -> None:
    """Drop what was measured of ``kind`` for ``model``."""
    kept = _KEPT.get(model)
    if kept is not None:
        for full in [k for k in kept if k[0] == kind]:
            del kept[full]


def input_signature(obj: Any) -> Any:
    """A hashable key of example inputs: shapes, dtypes and devices of their tensors (a
    callable: its identity)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, Mapping):
        return ("mapping", tuple((str(k), input_signature(v)) for k, v in obj.items()))
    if isinstance(obj, (tuple, list)):
        return ("sequence", tuple(input_signature(v) for v in obj))
    if callable(obj):
        return ("callable", id(obj))
    return ("value", repr(obj))
