"""What the saved-tensor hooks give autograd for one saved tensor, and how it comes back.

A :class:`Handle` holds either the tensor itself (kept as it is) or a :class:`Stored`
packing shared by every handle on the same storage, with the permutation, expansion and
view that rebuild the saved tensor's own layout from it. :meth:`Handle.restore` repeats
autograd's version check (saved-tensor hooks switch it off), so an in-place change of a
saved tensor that is still alive at backward raises autograd's usual error. Also here:
how the hooks tell a parameter from an activation (:func:`is_param_like`) and the layout
a tensor is packed in (:func:`canonical`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import ops
from ..compressors import Packing, restoring
from ..ops.masked import kept_floor

__all__ = [
    "INPLACE_MSG",
    "Enclosing",
    "Handle",
    "Stored",
    "canonical",
    "check_version",
    "is_param_like",
    "storage_ptr",
]

INPLACE_MSG = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{kind} {shape}] is at version {now}; expected version {then} instead. (Seen "
    "by actcore, which kept a compressed copy of it; enable anomaly detection with "
    "torch.autograd.set_detect_anomaly(True) to find the operation that modified it.)"
)


class Enclosing:
    """Saved-tensor hooks that were active around actcore's own when these were pushed (a
    user's, ``save_on_cpu``, a profiler's): every tensor actcore keeps goes on through them.

    Each tensor is handed to their pack once, however many saves share it, and is held
    here until :meth:`release` (the end of the forward that actcore's hooks cover): until
    then a later save can still share a packing, as without the enclosing hooks.
    """

    __slots__ = ("_pack", "_seen", "unpack")

    def __init__(self, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        self._pack = pack
        self.unpack = unpack
        self._seen: dict[int, tuple[Tensor, Any]] = {}

    def pack(self, t: Tensor) -> Any:
        hit = self._seen.get(id(t))
        if hit is None:
            hit = self._seen[id(t)] = (t, self._pack(t))
        return hit[1]

    def release(self) -> None:
        """Drop actcore's own references to what was handed on."""
        self._seen.clear()


class Stored:
    """The :class:`~actcore.compressors.Packing` of one storage region (and a ReLU output's
    mask), shared by every handle that saved it."""

    __slots__ = ("__weakref__", "enclosed", "mask", "packing")

    def __init__(self, packing: Packing, mask: Tensor | None = None):
        self.packing = packing
        self.mask = mask  # packed nonzero mask of a ReLU output, else None
        # (unpack, what the enclosing pack made of each tensor, of the mask): see enclose
        self.enclosed: tuple[Callable[[Any], Tensor], tuple, Any] | None = None

    def enclose(self, hooks: Enclosing) -> None:
        """Hand the packed tensors (and mask) to ``hooks``' pack, once, keeping only what it
        returns; :meth:`restore` gets them back through ``hooks``' unpack."""
        if self.enclosed is not None:
            return
        mask = None if self.mask is None else hooks.pack(self.mask)
        values = tuple(hooks.pack(t) for t in self.packing.tensors)
        self.enclosed = (hooks.unpack, values, mask)
        self.packing, self.mask = self.packing._replace(tensors=()), None

    def restore(self) -> Tensor:
        packing, mask = self.packing, self.mask
        if self.enclosed is not None:
            unpack, values, packed_mask = self.enclosed
            packing = packing._replace(tensors=tuple(unpack(v) for v in values))
            mask = None if packed_mask is None else unpack(packed_mask)
        out = restoring.restore(*packing)
        if mask is not None:  # the ReLU's zeros exactly, the rest kept positive
            # (read straight from the bits: 10x faster on CPU than where() on the unpacked
            # mask, bitwise the same; Handle.restore runs this under no_grad)
            return ops.apply_mask(out.clamp_min(kept_floor(out.dtype)), mask)
        return out


def check_version(t: Tensor, version: int) -> None:
    """Autograd's error if ``t`` changed in place since it was at ``version``."""
    if t._version != version:
        raise RuntimeError(
            INPLACE_MSG.format(kind=t.type(), shape=list(t.shape), now=t._version, then=version)
        )


class Handle:
    """What autograd holds for one saved tensor."""

    __slots__ = (
        "enclosed",
        "expand",
        "inv_perm",
        "perm_shape",
        "ref",
        "stored",
        "tensor",
        "version",
        "view",
    )

    def __init__(self) -> None:
        self.tensor: Tensor | None = None  # kept as is (pass-through)
        self.stored: Stored | None = None
        self.perm_shape: torch.Size | None = None
        self.inv_perm: tuple[int, ...] | None = None
        self.expand: torch.Size | None = None
        self.view: tuple | None = None  # (size, stride, offset) into a restored base
        self.ref: weakref.ref | None = None
        self.version = 0
        # (unpack, what an enclosing pack made of the kept tensor): see enclose
        self.enclosed: tuple[Callable[[Any], Tensor], Any] | None = None

    @classmethod
    def kept(cls, t: Tensor) -> Handle:
        """A handle keeping ``t`` as it is (a tensor outside the graph as the very object:
        a Q-layer's packed tensors must stay the objects the stash's records refer to)."""
        h = cls()
        h.tensor = t.detach() if t.requires_grad else t
        h.version = t._version
        return h

    @classmethod
    def packed(
        cls,
        t: Tensor,
        perm_shape: torch.Size,
        inv_perm: tuple[int, ...],
        expand: torch.Size | None = None,
        view: tuple | None = None,
    ) -> Handle:
        """A handle on a packing of ``t`` (its :attr:`stored` set by the caller): the
        restored data has ``perm_shape``, is permuted by ``inv_perm``, expanded to
        ``expand`` and viewed as ``view`` (when given); ``t``'s version is checked."""
        h = cls()
        h.perm_shape, h.inv_perm, h.expand, h.view = perm_shape, inv_perm, expand, view
        h.version = t._version
        try:
            h.ref = weakref.ref(t)
        except TypeError:
            h.ref = None
        return h

    def enclose(self, hooks: Enclosing, source: Tensor) -> None:
        """Pass what this handle keeps on to enclosing saved-tensor ``hooks`` (a user's,
        ``save_on_cpu``): the kept tensor, else the packing's tensors (once per
        :class:`Stored`). The in-place check stays: ``source``, the tensor autograd saved,
        is followed weakly."""
        t = self.tensor
        if t is None:
            if self.stored is not None:
                self.stored.enclose(hooks)
            return
        try:
            self.ref = weakref.ref(source)
        except TypeError:
            self.ref = None
        self.enclosed = (hooks.unpack, hooks.pack(t))
        self.tensor = None

    def restore(self) -> Tensor:
        """The saved tensor, rebuilt; RuntimeError if it was changed in place since."""
        if self.tensor is not None:
            check_version(self.tensor, self.version)
            return self.tensor
        if self.ref is not None:
            src = self.ref()
            if src is not None:
                check_version(src, self.version)
        if self.enclosed is not None:
            unpack, value = self.enclosed
            return unpack(value)
        assert self.stored is not None and self.perm_shape is not None
        assert self.inv_perm is not None
        with torch.no_grad():
            out = self.stored.restore().view(self.perm_shape).permute(self.inv_perm)
            if self.expand is not None:
                out = out.expand(self.expand)
            if self.view is not None:
                out = out.as_strided(*self.view)
        return out


def canonical(t: Tensor) -> tuple[Tensor, tuple[int, ...], torch.Size | None]:
    """``t`` without expanded dims, permuted into memory order; inverse perm; expand shape."""
    c = t
    expanded = False
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.size(d) > 1:
            c = c.narrow(d, 0, 1)
            expanded = True
    perm = sorted(range(c.dim()), key=lambda d: (-c.stride(d), d))
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return c.permute(perm), tuple(inv), (t.shape if expanded else None)


def storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage (0 when it has none that can be read)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def is_param_like(t: Tensor, param_ptrs: set[int]) -> bool:
    """Parameters, buffers, their views and autocast copies are not activations."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    if isinstance(base, nn.Parameter):
        return True
    if param_ptrs and storage_ptr(t) in param_ptrs:
        return True
    fn = (base if base is not None else t).grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        if isinstance(getattr(nxt, "variable", None), nn.Parameter):
            return True
    return False
