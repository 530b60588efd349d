"""Restoring a packing once for all the backward ops that read it.

One packing often has several readers in backward: a Llama layer's q, k and v projections
keep the same normed input, its gate and up projections another, and a tensor rebuilt from
packings (:class:`~actcore.compressors.Derived`: a SwiGLU's ``silu(gate) * up``, a norm's
output) is read by its product and by the next linear. Each used to dequantize (and rebuild)
on its own: on the Llama 4x512, 32 of a step's 65 channel-scaled unpacks and 16 of its 32
rebuilds were repeats.

Whoever keeps a packing for backward says so with :func:`expect`; :func:`restore` then
unpacks on the first read and hands the same tensor to the other readers, dropping it at
the last expected read, so a restored tensor lives from its first reader to its last, as
the plain model's saved tensor would have, never longer. Nothing here changes a value: a
read gets what its own unpacking would have made (unpacking is deterministic), or a fresh
unpacking where a reader changed the shared tensor in place since. A read that was never
expected unpacks on its own; an expected read that never comes (its op needed no gradient)
leaves its tensor to die with the packed tensors, at the end of backward at the latest.
Values are shared only while autograd is off (backward, not a ``create_graph`` one).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .base import Compressor, Packing, Tensors

__all__ = ["expect", "pending", "restore"]

_Key = tuple[Any, ...]


class _Entry:
    """The reads still expected of one packing, and its restored tensor once read."""

    __slots__ = ("comp", "expected", "refs", "value", "version")

    def __init__(self, comp: Compressor) -> None:
        # (held: the ids in the key, a Derived's function's among them, stay its own)
        self.comp = comp
        self.refs: tuple[weakref.ref, ...] = ()
        self.expected = 0
        self.value: torch.Tensor | None = None
        self.version = 0

    def holds(self, tensors: Tensors) -> bool:
        return len(self.refs) == len(tensors) and all(
            ref() is t for ref, t in zip(self.refs, tensors, strict=True)
        )


_TABLE: dict[_Key, _Entry] = {}
_LOCK = threading.Lock()  # (backward may run on one thread per device)


def _key(comp: Compressor, tensors: Tensors) -> _Key:
    return (comp.key(), *map(id, tensors))


def _forget(key: _Key, entry: _Entry) -> None:
    with _LOCK:
        if _TABLE.get(key) is entry:
            del _TABLE[key]


def _shared(comp: Compressor, tensors: Tensors) -> bool:
    return comp.lossy and bool(tensors)


def expect(packing: Packing) -> None:
    """One more read of ``packing`` will come in backward (and of the packings it is
    rebuilt from)."""
    comp, tensors = packing.compressor, tuple(packing.tensors)
    if not _shared(comp, tensors):
        return
    key = _key(comp, tensors)
    with _LOCK:
        entry = _TABLE.get(key)
        if entry is None or not entry.holds(tensors):
            entry = _Entry(comp)
            entry.refs = tuple(
                weakref.ref(t, lambda _r, key=key, entry=entry: _forget(key, entry))
                for t in tensors
            )
            _TABLE[key] = entry
        entry.expected += 1
    for part in comp.parts_of(tensors, packing.meta):
        expect(part)


def _consume(packing: Packing) -> None:
    """A read of ``packing`` that needs no unpacking (its rebuilt tensor was shared)."""
    comp, tensors = packing.compressor, tuple(packing.tensors)
    if not _shared(comp, tensors):
        return
    key = _key(comp, tensors)
    with _LOCK:
        entry = _TABLE.get(key)
        if entry is None or not entry.holds(tensors):
            return
        entry.expected -= 1
        if entry.expected <= 0:
            del _TABLE[key]
    for part in comp.parts_of(tensors, packing.meta):
        _consume(part)


def restore(comp: Compressor, tensors: Tensors, meta: Any) -> torch.Tensor:
    """``comp.unpack(tensors, meta)``, or the tensor an earlier read of the same packing
    restored while more reads are expected (see the module docstring)."""
    tensors = tuple(tensors)
    if not _shared(comp, tensors):
        return comp.unpack(tensors, meta)
    key = _key(comp, tensors)
    with _LOCK:
        entry = _TABLE.get(key)
        if entry is not None and not entry.holds(tensors):
            entry = None
        value = None if entry is None else entry.value
        if value is not None and value._version != entry.version:  # changed by a reader
            value = entry.value = None
    if entry is None:
        return comp.unpack(tensors, meta)
    if value is None:
        value = comp.unpack(tensors, meta)  # (reads its parts through restore)
    else:
        for part in comp.parts_of(tensors, meta):
            _consume(part)
    with _LOCK:
        entry.expected -= 1
        if entry.expected <= 0 or torch.is_grad_enabled():
            entry.value = None
            if entry.expected <= 0 and _TABLE.get(key) is entry:
                del _TABLE[key]
        else:
            entry.value, entry.version = value, value._version
    return value


def pending() -> int:
    """How many restored tensors are held for reads still to come (0 after a backward
    whose every expected read came)."""
    with _LOCK:
        return sum(entry.value is not None for entry in _TABLE.values())
