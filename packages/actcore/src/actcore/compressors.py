"""Compressors: turn a tensor saved for backward into a few compact tensors and back.

A compressor's ``pack(x)`` returns ``(tensors, meta)``: the tensors go through
``ctx.save_for_backward`` (so autograd's in-place checks, saved-tensor hooks and memory
accounting all see them), ``meta`` is small Python data. ``unpack(tensors, meta)`` rebuilds
the tensor. Both front doors (Q-layers and saved-tensor hooks) use these same objects.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops

__all__ = [
    "IDENTITY",
    "Compressor",
    "Derived",
    "PerSampleQuantize",
    "PrefetchQueue",
    "Quantize",
    "Swap",
    "Tensors",
    "ZeroValue",
    "sample_range_weights",
]

Tensors = tuple[torch.Tensor, ...]


class Compressor:
    """Base class: identity (keeps the tensor itself)."""

    name = "identity"
    lossy = False  # whether unpack(pack(x)) may differ from x

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        return (x,), None

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return tensors[0]

    def key(self) -> tuple:
        """Identifies the result of ``pack``: equal keys pack a tensor identically."""
        return (self.name,)


IDENTITY = Compressor()


@dataclass(frozen=True)
class Quantize(Compressor):
    """Per-group stochastic k-bit quantization (:func:`actcore.ops.quantize`)."""

    bits: int
    group_size: int = 256
    per_sample: bool = True
    stochastic: bool = True
    name = "quantize"
    lossy = True

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        p = ops.quantize(
            x,
            self.bits,
            group_size=self.group_size,
            stochastic=self.stochastic,
            per_sample=self.per_sample,
        )
        return p.tensors(), (p.shape, p.dtype, p.bits, p.group_size, p.per_sample)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        return ops.dequantize(ops.Packed(*tensors, *meta))

    def key(self) -> tuple:
        return (self.name, self.bits, self.group_size, self.per_sample, self.stochastic)


def sample_range_weights(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per sample, ``sum over its groups of size * range^2`` (float32, shape ``[N]``).

    Stochastic rounding of a group at ``b`` bits adds variance at most
    ``range^2 / (4 (2^b - 1)^2)`` per element, so this is (4 times) the sample's rounding
    variance at one step per range; it ranks samples by how much bits help them.
    """
    flat = x.detach().reshape(x.shape[0], -1)
    n, m = flat.shape
    if m == 0:
        return flat.new_zeros(n, dtype=torch.float32)
    pad = -m % group_size
    if pad:  # repeat each sample's first element: the last group's range is unchanged
        flat = torch.cat([flat, flat[:, :1].expand(n, pad)], 1)
    groups = flat.view(n, -1, group_size)
    span = (groups.amax(-1) - groups.amin(-1)).float()
    return (span.square() * group_size).sum(-1)


@dataclass(frozen=True)
class PerSampleQuantize(Compressor):
    """Per-group quantization with bits chosen per sample (ActNN-style adaptive bits).

    ``counts`` lists ``(bits, number of samples)``, most bits first, summing to the batch
    size. ``pack`` ranks the samples by :func:`sample_range_weights` (largest first) and
    gives the first ``counts[0][1]`` samples ``counts[0][0]`` bits, and so on; each bits
    class is quantized as one contiguous block. Counts are host data and the ranking stays
    on the device, so no host synchronisation is needed. Unbiased, as :class:`Quantize`.
    """

    counts: tuple[tuple[int, int], ...]
    group_size: int = 256
    stochastic: bool = True
    # sample_range_weights of the tensor to pack, when the caller has it already (the same
    # result, one pass less); not part of the compressor's identity
    weights: torch.Tensor | None = field(default=None, compare=False, repr=False)
    name = "per_sample_quantize"
    lossy = True

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        if sum(c for _, c in self.counts) != x.shape[0]:
            raise ValueError(f"counts {self.counts} do not cover a batch of {x.shape[0]}")
        weights = self.weights
        if weights is None:
            weights = sample_range_weights(x, self.group_size)
        order = torch.argsort(weights, descending=True)
        ranked = x.detach().index_select(0, order)
        tensors: list[torch.Tensor] = [order.to(torch.int32)]
        metas = []
        start = 0
        for bits, count in self.counts:
            if count == 0:
                continue
            p = ops.quantize(
                ranked[start : start + count],
                bits,
                group_size=self.group_size,
                stochastic=self.stochastic,
            )
            tensors.extend(p.tensors())
            metas.append((p.shape, p.dtype, p.bits, p.group_size, p.per_sample))
            start += count
        return tuple(tensors), tuple(metas)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        order = tensors[0].long()
        parts = [
            ops.dequantize(ops.Packed(*tensors[1 + 3 * i : 4 + 3 * i], *m))
            for i, m in enumerate(meta)
        ]
        ranked = torch.cat(parts)
        return torch.empty_like(ranked).index_copy_(0, order, ranked)

    def key(self) -> tuple:
        return (self.name, self.counts, self.group_size, self.stochastic)


_FUSED = "masked"  # ZeroValue meta tag: packed by ops.masked_quantize


@dataclass(frozen=True)
class ZeroValue(Compressor):
    """A tensor whose zeros are exactly a known 1-bit mask's zeros (a ReLU output).

    Keeps the mask tensor (shared with whoever saved it first, so it costs nothing twice)
    and the nonzero values only, compressed by ``inner`` (AC-GC's zero-value compression).
    With a one-row :class:`Quantize` as ``inner`` (what every route uses) the values are
    read and written at the mask's bits by :func:`actcore.ops.masked_quantize` and
    :func:`actcore.ops.masked_dequantize`, never searched for: the same bytes as quantizing
    ``x[x != 0]``. A ``seed`` attribute of ``inner`` (``SeededQuantize``) fixes the rounding.
    """

    mask: torch.Tensor  # pack_mask(x != 0), already saved by the layer that made x
    inner: Compressor
    name = "zero_value"
    lossy = True

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        q = self.inner
        if isinstance(q, Quantize) and not q.per_sample:
            seed = getattr(q, "seed", None)
            p = ops.masked_quantize(
                x, self.mask, q.bits, group_size=q.group_size, stochastic=q.stochastic, seed=seed
            )
            return (self.mask, *p), (_FUSED, x.shape, x.dtype, q.bits, q.group_size)
        values, meta = q.pack(x[x != 0])
        return (self.mask, *values), (x.shape, meta)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        if meta[0] == _FUSED:
            _, shape, dtype, bits, group_size = meta
            mask, payload, lo, step = tensors
            return ops.masked_dequantize(payload, lo, step, mask, bits, group_size, shape, dtype)
        shape, inner_meta = meta
        values = self.inner.unpack(tensors[1:], inner_meta)
        out = values.new_zeros(shape)
        out[ops.unpack_mask(tensors[0], shape)] = values
        return out

    def key(self) -> tuple:
        return (self.name, id(self.mask), *self.inner.key())


@dataclass(frozen=True, eq=False)
class Derived(Compressor):
    """A tensor rebuilt from other packings: ``fn(*restored parts)``.

    The parts are packings held anyway by whoever saved them (a norm's compressed input, an
    activation's input, the operands of a product, a dropout's mask), so keeping a tensor
    this way costs nothing: a normalization's output, an activation's output, a gated
    product, a dropout output. ``pack`` is not used (:func:`actcore.engine.packing_of`
    builds the tensors, the parts' tensors one after the other, and the meta, the parts'
    metas and tensor counts). Approximate like its parts: never for what must stay exact.
    """

    fn: Callable[..., torch.Tensor]
    parts: tuple[Compressor | None, ...]  # None: a None argument of fn
    name = "derived"
    lossy = True

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        metas, counts = meta
        restored, i = [], 0
        for comp, part_meta, n in zip(self.parts, metas, counts, strict=True):
            restored.append(None if comp is None else comp.unpack(tensors[i : i + n], part_meta))
            i += n
        with torch.no_grad():
            return self.fn(*restored)

    def key(self) -> tuple:
        return (self.name, id(self.fn), *(c and c.key() for c in self.parts))


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
class Swap(Compressor):
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

    @property
    def lossy(self) -> bool:  # type: ignore[override]
        return self.inner.lossy

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
