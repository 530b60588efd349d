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

import functools
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

    def __init__(self, comp: Compressor, key: _Key, tensors: Tensors) -> None:
        # (held: the ids in the key, a Derived's function's among them, stay its own)
        self.comp = comp
        # (one callback for all its tensors, holding the key, not the entry: no reference
        # cycle, so an entry dropped from the table is freed at once, not by the collector)
        died = functools.partial(_died, key)
        self.refs = tuple(weakref.ref(t, died) for t in tensors)
        self.expected = 0
        self.value: torch.Tensor | None = None
        self.version = 0

    def holds(self, tensors: Tensors) -> bool:
        return len(self.refs) == len(tensors) and all(
            ref() is t for ref, t in zip(self.refs, tensors, strict=True)
        )


_TABLE: dict[_Key, _Entry] = {}
_LOCK = threading.RLock()  # (backward may run on one thread per device; a tensor freed
# while it is held can call _forget)


def _forget(key: _Key, entry: _Entry) -> None:
    """A packed tensor died: its entry goes, and what it held with it."""
    with _LOCK:
        entry.value = None
        if _TABLE.get(key) is entry:
            del _TABLE[key]


def _died(key: _Key, ref: weakref.ref) -> None:
    """A packed tensor of the entry at ``key`` died (its weak reference ``ref``)."""
    with _LOCK:
        entry = _TABLE.get(key)
        if entry is not None and any(r is ref for r in entry.refs):
            _forget(key, entry)


def _found(comp: Compressor, tensors: Tensors) -> tuple[_Key, _Entry | None]:
    """The packing's key and its live entry, if any (under ``_LOCK``)."""
    key = (comp.key(), *map(id, tensors))
    entry = _TABLE.get(key)
    return key, entry if entry is not None and entry.holds(tensors) else None


def _read(key: _Key, entry: _Entry) -> bool:
    """Count one read of ``entry``; whether it was the last expected (under ``_LOCK``)."""
    entry.expected -= 1
    if entry.expected > 0:
        return False
    entry.value = None
    if _TABLE.get(key) is entry:
        del _TABLE[key]
    return True


def _shared(comp: Compressor, tensors: Tensors) -> bool:
    return comp.lossy and bool(tensors)


def expect(packing: Packing) -> None:
    """One more read of ``packing`` will come in backward (and of the packings it is
    rebuilt from)."""
    comp, tensors = packing.compressor, tuple(packing.tensors)
    if not _shared(comp, tensors):
        return
    with _LOCK:
        key, entry = _found(comp, tensors)
        if entry is None:
            entry = _TABLE[key] = _Entry(comp, key, tensors)
        entry.expected += 1
    for part in comp.parts_of(tensors, packing.meta):
        expect(part)


def _consume(packing: Packing) -> None:
    """A read of ``packing`` that needs no unpacking (its rebuilt tensor was shared)."""
    comp, tensors = packing.compressor, tuple(packing.tensors)
    if not _shared(comp, tensors):
        return
    with _LOCK:
        key, entry = _found(comp, tensors)
        if entry is not None:
            _read(key, entry)
    for part in comp.parts_of(tensors, packing.meta):
        _consume(part)


def restore(comp: Compressor, tensors: Tensors, meta: Any) -> torch.Tensor:
    """``comp.unpack(tensors, meta)``, or the tensor an earlier read of the same packing
    restored while more reads are expected (see the module docstring)."""
    tensors = tuple(tensors)
    if not _shared(comp, tensors):
        return comp.unpack(tensors, meta)
    with _LOCK:
        key, entry = _found(comp, tensors)
        value = None if entry is None else entry.value
        if entry is not None and value is not None and value._version != entry.version:
            value = entry.value = None  # a reader changed it in place
    if entry is None:
        return comp.unpack(tensors, meta)
    if value is None:
        value = comp.unpack(tensors, meta)  # (reads its parts through restore)
    else:
        for part in comp.parts_of(tensors, meta):
            _consume(part)
    with _LOCK:
        if not _read(key, entry):
            shared = not torch.is_grad_enabled()  # (a create_graph backward: its own)
            entry.value, entry.version = (value, value._version) if shared else (None, 0)
    return value


def pending() -> int:
    """How many restored tensors are held for reads still to come (0 after a backward
    whose every expected read came)."""
    with _LOCK:
        return sum(entry.value is not None for entry in _TABLE.values())
