"""The save/restore mechanism every Q-layer uses for the tensors it keeps for backward.

``stash(ctx, layer, [(x, role), ...])`` chooses a compressor for each tensor from the
layer's level (see :mod:`actcore.config`), packs it, and saves the packed tensors with
``ctx.save_for_backward``; ``unstash(ctx)`` rebuilds them in backward. Two tensors that are
the same data (same object, unchanged since) packed the same way are packed once, and a
ReLU output saved by the next layer reuses the ReLU's own 1-bit mask at levels with
``zero_value`` (its zeros are exactly the mask's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..compressors import (
    IDENTITY,
    Compressor,
    Derived,
    Packing,
    Quantize,
    Swap,
    Tensors,
    ZeroValue,
    restoring,
)
from ..compressors.channel_scaled import ChannelScales, scaled
from ..config import LevelSpec, config
from ..memory import saved_hooks
from ..memory.api import note_saved
from ..saved_tensors.handles import check_version
from . import roles
from .roles import CONV, NARROW_BITS, NORM, role_bits

__all__ = [
    "KEPT",
    "PACKED",
    "Scheme",
    "choose",
    "derive",
    "derive_from",
    "derive_output",
    "in_checkpoint",
    "is_checkpoint_hook",
    "is_stashed",
    "layer_spec",
    "mask_of",
    "needs_saving",
    "note_kept",
    "note_mask",
    "note_output",
    "observe",
    "packing_of",
    "records",
    "remember_packing",
    "source_part",
    "stash",
    "stashed_kind",
    "top_hooks",
    "unstash",
]


class _Entry(weakref.ref):
    """A table entry: a weak reference to its tensor, with the table key, the tensor's
    version when the record was made, and the record (one object besides the record: each
    costs the cyclic garbage collector, and a step makes hundreds)."""

    __slots__ = ("key", "record", "version")

    key: int
    record: dict
    version: int


class _TensorTable:
    """Per-tensor records that vanish with the tensor and go stale when it is modified."""

    def __init__(self) -> None:
        self._items: dict[int, _Entry] = {}
        self._on_dead = self._drop  # (one bound method for every entry's callback)

    def _drop(self, entry: _Entry) -> None:
        if self._items.get(entry.key) is entry:
            del self._items[entry.key]

    def get(self, x: torch.Tensor) -> dict | None:
        entry = self._items.get(id(x))
        if entry is None or entry() is not x or entry.version != x._version:
            return None
        return entry.record

    def setdefault(self, x: torch.Tensor) -> dict:
        found = self.get(x)
        if found is not None:
            return found
        entry = _Entry(x, self._on_dead)
        entry.key, entry.version, entry.record = id(x), x._version, {}
        self._items[entry.key] = entry
        return entry.record

    def __len__(self) -> int:
        return len(self._items)


_records = _TensorTable()


def records() -> _TensorTable:
    """The per-tensor records (packings, masks, what a tensor derives from)."""
    return _records


def note_mask(output: torch.Tensor, packed_mask: torch.Tensor) -> None:
    """Record that ``output``'s nonzeros are exactly ``packed_mask`` (a ReLU's own mask)."""
    _records.setdefault(output)["mask"] = packed_mask


def layer_spec(layer: Any) -> LevelSpec:
    """``layer``'s level as resolved at conversion (``act_spec``), else the process-wide one."""
    spec = getattr(layer, "act_spec", None)
    return spec if spec is not None else config.spec


_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def top_hooks() -> tuple[Any, Any] | None:
    """:func:`actcore.memory.saved_hooks.top_hooks`, None while Dynamo traces (it cannot
    trace the accessor)."""
    return None if torch.compiler.is_compiling() else saved_hooks.top_hooks()


def is_checkpoint_hook(pack: Any) -> bool:
    """Whether ``pack`` is ``torch.utils.checkpoint``'s (non-reentrant) pack hook."""
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint" and getattr(
        pack, "__qualname__", ""
    ).startswith(_CHECKPOINT_HOOKS)


def in_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s
    (non-reentrant): what is saved now is dropped and recomputed in backward anyway."""
    top = top_hooks()
    return top is not None and is_checkpoint_hook(top[0])


@runtime_checkable
class Scheme(Protocol):
    """What a converted layer's ``act_scheme`` (a bits scheme: :class:`actcore.adaptive.
    AdaptiveBits`, :class:`actcore.policy_scheme.PolicyScheme`) answers on the hot path."""

    def compressor(
        self, layer: Any, role: str, x: torch.Tensor, bits: int, mask: torch.Tensor | None
    ) -> Compressor | None:
        """The compressor for ``x``, which ``layer`` saves in ``role`` (``bits``: the
        level's for the role; ``mask``: a ReLU output's mask for zero-value storage), or
        None for the level's default."""
        ...

    def observe(
        self,
        layer: Any,
        grad: torch.Tensor,
        kernel: int,
        channel_dim: int,
        norm: bool,
        restored: torch.Tensor | None = None,
    ) -> None:
        """``layer``'s output gradient in backward (see :func:`observe`), for a scheme that
        takes gradient statistics."""
        ...


def choose(layer: Any, role: str, x: torch.Tensor, channel_dim: int | None = None) -> Compressor:
    """The compressor for tensor ``x`` that ``layer`` saves in ``role``.

    ``channel_dim``: the dim of ``x``'s channels, for keeping outlier channels apart
    (:class:`~actcore.compressors.ChannelScaled`); None infers it from the shape.

    A layer's ``act_scheme`` (e.g. :class:`actcore.adaptive.AdaptiveBits`), when set, is
    asked first through ``scheme.compressor(layer, role, x, bits, mask)`` (``bits``: the
    level's bits for the role, ``mask``: the ReLU mask for zero-value storage or None); it
    returns a compressor, or None for the level's default.

    Inside a region checkpointed by ``torch.utils.checkpoint`` (non-reentrant) it is the
    identity: checkpoint drops what is saved there and recomputes it in backward, so
    compressing would only cost time, and the recomputation must save tensors of the same
    shapes as the forward did (a ReLU-mask or adaptive-bits decision could differ). A
    linear marked ``act_feeds_loss`` (a language model's head, see :mod:`actcore.layers.loss`)
    keeps its input as it is: the loss holds that very tensor, so it costs nothing more.
    """
    spec = layer_spec(layer)
    if in_checkpoint():
        return IDENTITY
    if role == CONV and getattr(layer, "act_feeds_loss", False):
        return IDENTITY  # a loss head: the loss keeps this very input (actcore.layers.loss)
    bits = role_bits(spec, role)
    if bits is not None and role == CONV and roles.expands(layer):
        bits = max(bits, NARROW_BITS)  # a low-rank input (LoRA's B): cheap, so kept finer
    if bits is None or x.numel() < config.min_numel or not x.is_floating_point():
        base: Compressor = IDENTITY
    else:
        record = _records.get(x) if spec.zero_value else None
        mask = record.get("mask") if record is not None else None
        scheme: Scheme | None = getattr(layer, "act_scheme", None)
        if role == NORM:  # few values per channel: finer (adaptive plans keep the floor)
            bits = max(bits, roles.batch_norm_bits(x))
        chosen = None if scheme is None else scheme.compressor(layer, role, x, bits, mask)
        if chosen is not None:
            base = chosen
        elif mask is not None:
            base = ZeroValue(mask, Quantize(bits, config.group_size, per_sample=False))
        else:
            base = Quantize(bits, config.group_size, stochastic=config.stochastic)
        if role in roles.SCALED_ROLES and not isinstance(base, ZeroValue):
            # outlier channels apart; exact where backward is nonlinear in the tensor. A
            # conv / linear input reuses its scales between the scheme's statistics steps,
            # a module's other inputs between refreshes (a functional call has no layer of
            # its own to keep them on)
            collecting = getattr(scheme, "collecting", None)
            scales, refresh = None, True
            if role == CONV and collecting is not None:
                scales, refresh = _channel_scales(layer, role, x), collecting()
            elif role != CONV and isinstance(layer, torch.nn.Module):
                scales = _channel_scales(layer, role, x)
                refresh = scales is None or scales.due()
            base = scaled(
                base,
                x,
                config.group_size,
                exact=role != CONV,
                dim=channel_dim,
                scales=scales,
                refresh=refresh,
            )
    return Swap(base) if spec.swap else base


def _channel_scales(layer: Any, role: str, x: torch.Tensor) -> ChannelScales | None:
    """``layer``'s :class:`ChannelScales` for inputs like ``x`` in ``role`` (made on first
    use; a plain attribute, resumed through :mod:`actcore.resume`'s ``channel_scales``)."""
    if layer is None:
        return None
    table = getattr(layer, "act_channel_scales", None)
    if table is None:
        table = {}
        try:
            object.__setattr__(layer, "act_channel_scales", table)
        except AttributeError:  # (a layer object that takes no attributes)
            return None
    return table.setdefault((role, x.dim()), ChannelScales())


def observe(
    ctx: Any,
    grad: torch.Tensor,
    kernel: int = 1,
    channel_dim: int = 1,
    norm: bool = False,
    restored: torch.Tensor | None = None,
) -> None:
    """Hand a layer's output gradient to its ``act_scheme`` (for gradient statistics).

    ``kernel``: weights each input element meets per output position (a convolution's
    kernel size, else 1); ``channel_dim``: the output channel dim (-1 for linear layers);
    ``norm``: a normalization layer (its weight gradient is ``sum(grad * x_hat)``);
    ``restored``: a linear layer's input as restored for backward.
    """
    layer = getattr(ctx, "act_layer", None)
    scheme: Scheme | None = getattr(layer, "act_scheme", None)
    if scheme is not None:
        scheme.observe(layer, grad, kernel, channel_dim, norm, restored)


def stash(
    ctx: Any,
    layer: Any,
    items: Sequence[tuple[torch.Tensor | None, str | Compressor]],
    watch: Sequence[torch.Tensor] = (),
) -> list[Packing | None]:
    """Pack and save ``items`` (tensor, role or compressor) on ``ctx`` for :func:`unstash`;
    returns each item's packing (None for a None item).

    One rule for in-place changes, whatever a tensor's size: a packed item, and each tensor
    of ``watch`` (the input an item was computed from, such as a norm's input for its
    normalized copy), that is changed in place and still alive at backward raises autograd's
    error in :func:`unstash`, as it does for a tensor kept as it is.
    """
    tensors: list[torch.Tensor] = []
    plan: list[tuple[int, Compressor | None, Any]] = []
    parts: list[Packing | None] = []
    held: list[torch.Tensor | None] = []  # per tensor: held on ctx, or None (saved)
    direct = _holds_packings()
    for x, how in items:
        if x is None:
            plan.append((0, None, None))
            parts.append(None)
            continue
        comp = how if isinstance(how, Compressor) else choose(layer, how, x)
        part = _pack_once(comp, x)
        restoring.expect(part)  # (unstash reads it through restoring.restore)
        plan.append((len(part.tensors), part.compressor, part.meta))
        parts.append(part)
        # saved-tensor hooks must keep these as they are: see stashed_kind. A packing's own
        # tensors are new; a derived one holds other packings' tensors (a weight among them)
        made = part.compressor is not IDENTITY and not isinstance(part.compressor, Derived)
        derived = _packing_made(part) if direct and not made else ()
        for t in part.tensors:
            own = made and t.data_ptr() != x.data_ptr()  # (x itself, or its memory: kept)
            if direct and (own or any(t is d for d in derived)):
                note_saved(t)  # (what the hooks would have passed through, and counted)
                held.append(t)
                continue
            _records.setdefault(t)["stashed"] = PACKED if own else KEPT
            held.append(None)
            tensors.append(t)
    ctx.save_for_backward(*tensors)
    ctx.act_held = held if any(t is not None for t in held) else None
    ctx.act_plan = plan
    ctx.act_layer = layer
    copied = [x for (x, _), (_, comp, _) in zip(items, plan, strict=True) if comp is not IDENTITY]
    ctx.act_versions = [(weakref.ref(t), t._version) for t in (*copied, *watch) if t is not None]
    return parts


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _packing_made(packing: Packing) -> list[torch.Tensor]:
    """The tensors of a :class:`~actcore.compressors.Derived` packing that lossy packings
    made (codes, ranges, scales: never a weight it refers to, never an op's output)."""
    found: list[torch.Tensor] = []
    for part in packing.compressor.parts_of(packing.tensors, packing.meta):
        if isinstance(part.compressor, Derived):
            found.extend(_packing_made(part))
        elif part.compressor.lossy:
            found.extend(part.tensors)
    return found


def _holds_packings() -> bool:
    """Whether :func:`stash` holds the tensors its packings make on ``ctx`` itself, past
    the saved-tensor hooks: where the innermost hooks are a model scope's own, which would
    pass them through untouched (two Python calls a tensor, hundreds a step), and backward
    can tell whether the graph is kept (to free them after their backward, as autograd frees
    saved tensors). Where other hooks are innermost (checkpoint's, a user's, a tracker's),
    or a user's enclose the scope's (``save_on_cpu``), they get them all as saved tensors; an
    active tracker is told of held ones (:func:`~actcore.memory.note_saved`)."""
    if _KEEP_GRAPH is None:
        return False
    top = top_hooks()
    holds = getattr(top[0], "act_holds_packings", None) if top is not None else None
    return holds is not None and holds()


def derive_output(ctx: Any, fn: Any, parts: Sequence[Packing | None], affine: bool = False) -> None:
    """In an autograd function's forward: its output is ``fn(*restored parts)`` (None parts
    stand for None arguments; ``affine``: ``fn`` is affine in each part); recorded on the
    output by :func:`note_output` once ``apply`` has returned it."""
    ctx.act_derive = (fn, tuple(parts), affine)


def note_output(out: Any) -> Any:
    """After ``apply``: record what ``out`` derives from (see :func:`derive_output`)."""
    node = getattr(out, "grad_fn", None)
    found = getattr(node, "act_derive", None)
    if found is not None:
        node.act_derive = None
        derive(out, *found)
    return out


KEPT = "kept"
PACKED = "packed"


def stashed_kind(t: torch.Tensor) -> str | None:
    """How a Q-layer's :func:`stash` saved ``t`` (unchanged since): :data:`PACKED`, a tensor
    a packing made (codes, ranges, scales: never a parameter, nothing derives from it), or
    :data:`KEPT`, a tensor saved as it is; None when it did not."""
    record = _records.get(t)
    return None if record is None else record.get("stashed")


def is_stashed(t: torch.Tensor) -> bool:
    """Whether ``t`` (unchanged since) was saved by a Q-layer through :func:`stash`.

    Such a tensor is already packed at the layer's level, or must stay exact (weights,
    normalization statistics, masks): the hooks route passes it through untouched.
    """
    return stashed_kind(t) is not None


def _pack_once(comp: Compressor, x: torch.Tensor) -> Packing:
    """Pack ``x``, or reuse a packing of the same unchanged tensor that is still held.

    A packing with the same compressor key is reused first, else the first lossy packing
    that either route (Q-layers or the saved-tensor hooks) made of ``x``: a tensor two ops
    keep is stored once. Returns the compressor that unpacks the result (``comp``, or the
    earlier one).
    """
    if comp is IDENTITY:
        return Packing(comp, *comp.pack(x))
    record = _records.setdefault(x)
    earlier = _live(record.get(comp.key()))
    if earlier is None and comp.lossy:
        earlier = _live(record.get(_FIRST))
        if earlier is None:
            earlier = _derived(record)
    if earlier is not None:
        return earlier
    tensors, meta = comp.pack(x)
    remember_packing(x, comp, tensors, meta, record)
    return Packing(comp, tuple(tensors), meta)


_FIRST = "first lossy packing"
_DERIVED = "derived from"
_KEPT = "kept as it is"


def _live(entry: Any) -> Packing | None:
    if entry is None:
        return None
    comp, refs, meta = entry
    tensors = tuple(ref() for ref in refs)
    if any(t is None for t in tensors):
        return None
    return Packing(comp, tensors, meta)


def remember_packing(
    x: torch.Tensor, comp: Compressor, tensors: Tensors, meta: Any, record: dict | None = None
) -> None:
    """Record that ``x`` (unchanged since) was packed by ``comp`` into ``tensors``.

    Held weakly (never extends their life). Later saves of ``x`` reuse it: through
    :func:`stash` (the same compressor, or any lossy one) and through the saved-tensor
    hooks (:func:`packing_of`).
    """
    if record is None:
        record = _records.setdefault(x)
    entry = (comp, tuple(weakref.ref(t) for t in tensors), meta)
    record[comp.key()] = entry
    if comp.lossy and _live(record.get(_FIRST)) is None:
        record[_FIRST] = entry


def packing_of(x: torch.Tensor) -> Packing | None:
    """A lossy packing of ``x`` (unchanged since) still held: its own first one, else a
    :class:`~actcore.compressors.Derived` one (``x`` rebuilt from the packings it was made
    from, see :func:`derive`); None if neither."""
    record = _records.get(x)
    if record is None:
        return None
    found = _live(record.get(_FIRST))
    return found if found is not None else _derived(record)


def source_part(x: torch.Tensor) -> Packing | None:
    """How ``x`` can be restored in backward, if it can: a packing of it, or ``x`` itself
    when it is held exact anyway (parameters, buffers, tensors a save kept as they are)."""
    found = packing_of(x)
    if found is not None:
        return found
    record = _records.get(x)
    if isinstance(x, torch.nn.Parameter) or (record is not None and record.get(_KEPT)):
        return Packing(IDENTITY, (x,), None)
    return None


def note_kept(x: torch.Tensor) -> None:
    """Record that a save keeps ``x`` as it is (so a derived tensor may refer to it)."""
    _records.setdefault(x)[_KEPT] = True


def derive(
    out: torch.Tensor, fn: Any, parts: Sequence[Packing | None], affine: bool = False
) -> None:
    """Record that ``out`` is ``fn(*restored parts)`` (a None part is passed as None; parts
    are held weakly: this never extends their life). ``affine``: ``fn`` is affine in each
    part, so the restored ``out`` is unbiased where its parts are (:class:`Derived`).

    A later save of ``out`` (a Q-layer's stash, the saved-tensor hooks) keeps a reference to
    these packings instead of a copy of its own: normalization and activation outputs,
    products of saved operands, dropout outputs cost no memory of their own.
    """
    entry = (
        fn,
        tuple(
            None if part is None else (part[0], tuple(weakref.ref(t) for t in part[1]), part[2])
            for part in parts
        ),
        affine,
    )
    _records.setdefault(out)[_DERIVED] = entry


def derive_from(out: torch.Tensor, fn: Any, sources: Sequence[Any], affine: bool = False) -> bool:
    """:func:`derive` ``out = fn(*sources)`` if every tensor source can be restored (non-tensor
    sources are constants); returns whether it could."""
    parts: list[Packing] = []
    constants: list[Any] = []
    for src in sources:
        if isinstance(src, torch.Tensor):
            part = source_part(src)
            if part is None:
                return False
            parts.append(part)
            constants.append(None)
        else:
            constants.append(src)
    if all(c is None for c in constants):
        derive(out, fn, parts, affine)
        return True

    def with_constants(*restored: torch.Tensor, _fn=fn, _constants=tuple(constants)):
        it = iter(restored)
        return _fn(*(next(it) if c is None else c for c in _constants))

    derive(out, with_constants, parts, affine)
    return True


def _derived(record: dict) -> Packing | None:
    entry = record.get(_DERIVED)
    if entry is None:
        return None
    fn, parts, affine = entry
    comps, tensors, metas, counts = [], [], [], []
    for part in parts:
        if part is None:
            comps.append(None)
            metas.append(None)
            counts.append(0)
            continue
        comp, refs, meta = part
        held = tuple(ref() for ref in refs)
        if any(t is None for t in held):
            return None
        comps.append(comp)
        tensors.extend(held)
        metas.append(meta)
        counts.append(len(held))
    derived = Derived(fn, tuple(comps), affine)
    return Packing(derived, tuple(tensors), (tuple(metas), tuple(counts)))


def mask_of(x: torch.Tensor) -> torch.Tensor | None:
    """The packed 1-bit mask of ``x``'s nonzeros recorded by :func:`note_mask`, if any."""
    record = _records.get(x)
    return None if record is None else record.get("mask")


def unstash(ctx: Any) -> list[torch.Tensor | None]:
    """The tensors :func:`stash` saved, rebuilt (decompressed) in order; autograd's error
    if a packed or watched tensor was changed in place since (see :func:`stash`)."""
    for ref, version in getattr(ctx, "act_versions", ()):
        source = ref()
        if source is not None:
            check_version(source, version)
    saved = ctx.saved_tensors
    held = getattr(ctx, "act_held", None)
    if held is _FREED:
        raise RuntimeError(_SECOND_BACKWARD)
    if held is not None:  # (the held tensors in their places among the saved ones)
        rest = iter(saved)
        saved = tuple(next(rest) if t is None else t for t in held)
        if not torch.compiler.is_compiling() and not _KEEP_GRAPH():
            ctx.act_held = _FREED  # freed after their backward, as autograd frees saved tensors
    out: list[torch.Tensor | None] = []
    i = 0
    for n, comp, meta in ctx.act_plan:
        out.append(None if comp is None else restoring.restore(comp, saved[i : i + n], meta))
        i += n
    return out


_FREED = "freed"  # ctx.act_held once its backward ran without retain_graph
_SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed): an actcore layer's packed tensors are freed when "
    "its backward runs. Specify retain_graph=True if you need to backward through the graph "
    "a second time."
)


def needs_saving(*tensors: torch.Tensor | None) -> bool:
    """Whether a layer's own compressing autograd Function should run for these inputs:
    autograd will need a backward for them, and torch.compile is not tracing (a compiled
    graph runs the plain op, and the scope's saved-tensor hooks, inlined into the graph,
    pack what it saves: :mod:`actcore.saved_tensors.compiled`)."""
    return (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in tensors)
        and not torch.compiler.is_compiling()
    )
