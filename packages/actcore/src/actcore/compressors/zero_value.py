"""``ZeroValue``: a ReLU output kept as its known 1-bit mask plus its nonzeros (AC-GC).

How many values there are is known on the device only. Reading it back would make every
pack wait for the GPU (a host synchronisation per ReLU output), so on CUDA the values are
packed into buffers sized for the whole tensor (:func:`actcore.ops.masked_quantize_padded`)
while the count travels to pinned host memory behind them; each later zero-value pack or
unpack cuts the payloads whose count has arrived to their exact size, in place (the same
tensor object, so whoever holds the packing holds the cut one). Nothing waits: a payload
whose count is not there yet stays at its full size, which decodes the same. The groups'
``lo`` and ``step`` (2 bytes each per group of 256 values) stay sized for the whole tensor:
cutting them too would cost more calls per pack than the ~1% of bytes they hold.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import ops
from ..memory import note_moved, storage_key
from ..native import loader as _native
from ..ops.bitpack import packed_nbytes
from .base import Compressor, Tensors
from .quantize import Quantize

__all__ = ["ZeroValue", "settle", "unsettled"]

_FUSED = "masked"  # ZeroValue meta tag: packed by ops.masked_quantize


class _Unsettled(NamedTuple):
    """A padded payload waiting for its count."""

    payload: weakref.ref
    count: torch.Tensor  # on the host (pinned) once ``arrived`` has happened
    arrived: torch.cuda.Event | None  # None: ``count`` is already on the host
    stream: torch.cuda.Stream | None
    bits: int


_PENDING: list[_Unsettled] = []
_LOCK = threading.Lock()


def _pads(x: torch.Tensor) -> bool:
    """Whether ``x``'s nonzeros are packed without waiting for their count: eager CUDA with
    actcore's kernels (a CPU has nothing to wait for; a compiled graph sizes its own)."""
    return (
        x.is_cuda
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
        and _native.ready("masked_quantize_padded")
    )


def _expect(payload: torch.Tensor, count: torch.Tensor, bits: int) -> None:
    """Queue a padded ``payload`` for cutting once ``count`` reaches the host."""
    if count.is_cuda:
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(count, non_blocking=True)
        arrived: torch.cuda.Event | None = torch.cuda.Event()
        arrived.record()
        stream: torch.cuda.Stream | None = torch.cuda.current_stream(count.device)
    else:
        host, arrived, stream = count, None, None
    with _LOCK:
        _PENDING.append(_Unsettled(weakref.ref(payload), host, arrived, stream, bits))


def _cut(u: _Unsettled) -> None:
    payload = u.payload()
    if payload is None:
        return
    width = packed_nbytes(int(u.count.numpy()), u.bits)  # (numpy: a host read, no op call)
    if payload.shape[1] <= width:
        return
    on_stream = torch.cuda.stream(u.stream) if u.stream is not None else contextlib.nullcontext()
    before = storage_key(payload)
    with torch.no_grad(), on_stream:
        exact = payload[:, :width].clone()
        # the kept bytes do not change: autograd, which may have saved the payload, must not
        # see the cut as a write
        with torch.autograd.grad_mode._unsafe_preserve_version_counter(payload):
            payload.set_(exact)
    note_moved(payload, before)  # an active tracker counts the cut storage from now on


def settle(*, wait: bool = False) -> int:
    """Cut every padded zero-value payload whose count has reached the host to its exact size;
    with ``wait``, wait for the counts still on their way first. Returns how many remain."""
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    left = []
    for u in pending:
        if u.arrived is not None and not u.arrived.query():
            if not wait:
                left.append(u)
                continue
            u.arrived.synchronize()
        _cut(u)
    with _LOCK:
        _PENDING[:0] = left
        return len(_PENDING)


def unsettled() -> int:
    """How many padded zero-value packings wait for their count (see :func:`settle`)."""
    with _LOCK:
        return len(_PENDING)


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

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """The zeros are exact; the values as ``inner``."""
        return self.inner.unbiased

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        q = self.inner
        if isinstance(q, Quantize) and not q.per_sample:
            seed = getattr(q, "seed", None)
            options = {"group_size": q.group_size, "stochastic": q.stochastic, "seed": seed}
            if _pads(x):
                if _PENDING:
                    settle()
                *p, count = ops.masked_quantize_padded(x, self.mask, q.bits, **options)
                _expect(p[0], count, q.bits)
            else:
                p = ops.masked_quantize(x, self.mask, q.bits, **options)
            return (self.mask, *p), (_FUSED, x.shape, x.dtype, q.bits, q.group_size)
        values, meta = q.pack(x[x != 0])
        return (self.mask, *values), (x.shape, meta)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        if meta[0] == _FUSED:
            _, shape, dtype, bits, group_size = meta
            mask, payload, lo, step = tensors
            if _PENDING:
                settle()
            return ops.masked_dequantize(payload, lo, step, mask, bits, group_size, shape, dtype)
        shape, inner_meta = meta
        values = self.inner.unpack(tensors[1:], inner_meta)
        out = values.new_zeros(shape)
        out[ops.unpack_mask(tensors[0], shape)] = values
        return out

    def key(self) -> tuple:
        return (self.name, id(self.mask), *self.inner.key())
