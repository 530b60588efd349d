"""``Swap``: packed tensors moved to pinned CPU memory, prefetched back in backward.

:class:`PrefetchQueue` keeps the swapped-out entries in pack order, so that unpacking one
starts the copies of the next ones backward will need.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .base import IDENTITY, Compressor, Tensors, Wrapping

__all__ = ["PrefetchQueue", "Swap"]


class PrefetchQueue:
    """Swapped-out entries in pack order, so that backward can fetch ahead.

    Backward consumes saved tensors roughly in reverse pack order, so when the entry with
    sequence number ``s`` is unpacked, the next ones needed are the live, not yet fetched
    entries just before it: :meth:`upcoming` returns up to ``depth`` of them, nearest first.
    Entries are held weakly (the queue never keeps swapped data alive). Thread-safe (CUDA
    backward runs on autograd's device threads).
    """

    def __init__(self) -> None:
        self._seq = 0
        self._entries: dict[int, weakref.ref] = {}  # insertion order == pack order
        self._lock = threading.Lock()

    def add(self, entry: Any) -> int:
        """Register ``entry`` (it must have a ``fetched`` attribute); its sequence number."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._entries[seq] = weakref.ref(entry, lambda _r, seq=seq: self._drop(seq))
            return seq

    def _drop(self, seq: int) -> None:
        self._entries.pop(seq, None)

    def upcoming(self, seq: int, depth: int) -> list[Any]:
        """Up to ``depth`` live entries packed before ``seq`` with nothing fetched, nearest
        first (the order in which backward will ask for them)."""
        out: list[Any] = []
        with self._lock:
            earlier = [k for k in self._entries if k < seq]
            for k in reversed(earlier):
                if len(out) >= depth:
                    break
                entry = self._entries[k]()
                if entry is not None and entry.fetched is None:
                    out.append(entry)
        return out

    def __len__(self) -> int:
        return len(self._entries)


class _SwapEntry:
    """Host copies of one packed tensor group, with the events that order the copies."""

    __slots__ = ("__weakref__", "device", "fetched", "host", "ready", "seq")

    def __init__(self, host: Tensors, device: torch.device, ready: Any) -> None:
        self.host = host
        self.device = device
        self.ready = ready  # event after the device->host copies (on the packing stream)
        self.fetched: tuple[Tensors, Any] | None = None  # device copies + their event
        self.seq = -1


_QUEUES: dict[torch.device, PrefetchQueue] = {}
_SIDE_STREAMS: dict[torch.device, Any] = {}
_GLOBAL_LOCK = threading.Lock()


def _queue(device: torch.device) -> PrefetchQueue:
    with _GLOBAL_LOCK:
        q = _QUEUES.get(device)
        if q is None:
            q = _QUEUES[device] = PrefetchQueue()
        return q


def _side_stream(device: torch.device) -> Any:
    with _GLOBAL_LOCK:
        s = _SIDE_STREAMS.get(device)
        if s is None:
            s = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        return s


def _prefetch(entry: _SwapEntry) -> None:
    """Start ``entry``'s host->device copies on the side stream (after its D2H copies)."""
    side = _side_stream(entry.device)
    side.wait_event(entry.ready)
    with torch.cuda.stream(side):
        dev = tuple(t.to(entry.device, non_blocking=True) for t in entry.host)
        done = torch.cuda.Event()
        done.record(side)
    entry.fetched = (dev, done)


@dataclass(frozen=True)
class Swap(Wrapping):
    """Moves what ``inner`` packs to pinned CPU memory, asynchronously; back in backward.

    On a CPU tensor it is ``inner`` alone (there is nowhere to swap to). On CUDA, unpacking
    one tensor starts the host->device copies of the next ``prefetch`` tensors backward will
    need (those packed just before it) on a side stream; the consuming stream waits for them
    with an event and the copies are ``record_stream``-ed to it, so the copy of the next
    layer's tensors overlaps the current layer's backward.
    """

    inner: Compressor = IDENTITY
    prefetch: int = 2
    name = "swap"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        tensors, meta = self.inner.pack(x)
        if x.device.type != "cuda":
            return tensors, (None, meta)
        host = []
        for t in tensors:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        entry = _SwapEntry(tuple(host), x.device, ready)
        entry.seq = _queue(x.device).add(entry)
        return tuple(host), (x.device, meta, entry)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        device, inner_meta = meta[0], meta[1]
        if device is not None:
            entry: _SwapEntry | None = meta[2] if len(meta) > 2 else None
            stream = torch.cuda.current_stream(device)
            fetched = None if entry is None else entry.fetched
            if fetched is not None:
                entry.fetched = None  # type: ignore[union-attr]
                dev, done = fetched
                stream.wait_event(done)
                for t in dev:
                    t.record_stream(stream)  # allocated on the side stream, used here
                tensors = dev
            else:
                if entry is not None:
                    stream.wait_event(entry.ready)
                tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
            if entry is not None and self.prefetch > 0:
                for nxt in _queue(device).upcoming(entry.seq, self.prefetch):
                    _prefetch(nxt)
        return self.inner.unpack(tensors, inner_meta)

    def key(self) -> tuple:
        return (self.name, *self.inner.key())
