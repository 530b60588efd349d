"""Storage identity: which storage a saved tensor keeps alive, its bytes, and the tensors
inside a container or a compressed handle (:func:`storage_of` is the one storage key of
actcore; the other helpers are private to :mod:`actcore.memory`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["storage_of"]

_MAX_DEPTH = 8  # how deep note_saved / ctx walking looks into nested containers


def storage_of(t: Tensor) -> tuple[Any, int]:
    """(key, bytes) of the storage behind ``t``; a view is charged its whole storage."""
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key: Any = (t.device, ptr) if ptr else ("impl", storage._cdata)
        return key, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        # other storage-less tensors (nested...): count the elements, no dedup
        return ("tensor", id(t)), t.numel() * t.element_size()


_COMPRESSED_SPARSE = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def sparse_parts(t: Tensor) -> tuple[Tensor, ...] | None:
    """The dense tensors a sparse tensor is made of (None for a strided or other tensor)."""
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    names = _COMPRESSED_SPARSE.get(t.layout)
    if names is None:
        return None
    return (*(getattr(t, n)() for n in names), t.values())


def is_param(t: Tensor) -> bool:
    """True for an ``nn.Parameter`` or a view of one (e.g. ``weight.t()``)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[Tensor]:
    """Tensors in ``obj``: a tensor, containers of them, objects with ``tensors()``."""
    if isinstance(obj, Tensor):
        yield obj
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from iter_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, depth + 1)
    elif not isinstance(obj, (nn.Module, type)):
        tensors = getattr(obj, "tensors", None)
        if callable(tensors):
            yield from iter_tensors(tensors(), depth + 1)
