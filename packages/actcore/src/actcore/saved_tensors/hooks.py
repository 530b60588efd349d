"""The saved-tensor hooks route: compress whatever autograd saves, for any architecture.

``compress_saved_tensors(policy)`` is a context manager over the public
:class:`torch.autograd.graph.saved_tensors_hooks`; it needs no model::

    with actcore.compress_saved_tensors("G1.2"):
        loss = f(x).sum()      # saved activations are kept at 2 bits
    loss.backward()            # restored (dequantized) here

What the pack hook does with each saved tensor:

* parameters and buffers (``nn.Parameter``, views of one such as the ``weight.t()`` that
  ``linear`` saves, autocast copies of one, and any tensor on a registered model's
  parameter/buffer storage) are kept as they are;
* integer tensors, tensors below ``min_numel`` elements and non-strided tensors are kept;
* ``bool`` tensors (dropout masks, comparisons) are packed losslessly at 1 bit;
* tensors saved by ops whose backward compares or divides saved values (``amax``,
  ``maximum``, ``scatter_reduce(reduce="amax")``, inf-norms, ``prod``... see
  :mod:`actcore.saved_tensors.exact_ops`) are kept exact, as quantizing them would give NaN or zero
  gradients; so are log-probabilities (``log_softmax``'s output, which ``cross_entropy``
  saves: its backward exponentiates them, and ``E[exp(q(x))] != exp(x)``), and softmax,
  sigmoid and tanh outputs keep at least :data:`PROBABILITY_BITS`;
* floating tensors (fp32/fp16/bf16/fp64) go through the policy's compressor (k-bit stochastic
  quantization, optionally swapped to CPU). The output of a ReLU additionally keeps its
  nonzero mask at 1 bit, so ReLU's backward sees exactly the same mask (no biased gradient);
* ``F.scaled_dot_product_attention`` and ``F.multi_head_attention_forward`` run through
  :class:`actcore.layers.attention.AttentionFunction`: q, k, v are packed (q and k with the same
  feature dims exact), and backward reruns the call on them, as the layer route does (a
  fused kernel's own backward, from rounded q and k and an exact ``logsumexp``, is biased
  and with an outlier feature overflows);
* a storage saved twice (the same tensor, or a permuted/expanded view of it, e.g. ``x`` and
  ``x.t()``) while unchanged is stored once.

The unpack hook rebuilds a tensor of the same dtype, shape and (for dense or expanded views)
strides from the :class:`actcore.saved_tensors.handles.Handle` the pack hook gave autograd. Because
hooks switch off autograd's version check, it is repeated there: an in-place change of a
saved tensor that is still alive at backward raises autograd's usual error.

Nesting: saved-tensor hooks are a stack and the innermost active hooks win. Inside a region
checkpointed with ``torch.utils.checkpoint`` (non-reentrant), checkpoint's own hooks see every
saved tensor and recompute it in backward, so nothing there is compressed; what checkpoint
itself keeps (the region's inputs) goes through these hooks and is compressed, and the
recomputation starts from the restored inputs. Hooks pushed inside our block likewise take
over (e.g. ``actcore.memory.track`` then only counts what we report via ``note_saved``).
Another's hooks around ours (a user's, ``save_on_cpu``) are handed what we keep
(:class:`actcore.saved_tensors.handles.Enclosing`): offloading compressed tensors works.

Not detected: float tensors that happen to hold only 0 and 1 (telling would need a
data-dependent check, i.e. a device sync per tensor); they are quantized like any other.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .. import memory, ops, rng
from ..compressors import (
    ChannelScaled,
    Compressor,
    MaskBits,
    Packing,
    Quantize,
    SeededQuantize,
    Swap,
    ZeroValue,
    restoring,
)
from ..compressors.channel_scaled import ChannelScales, scaled
from ..layers import roles, stash
from ..layers.attention import shared_exact_dims
from ..layers.routing import AttentionRouter
from ..policies import as_policy
from . import compiled
from .graph_treatment import GraphPolicy, KindBits
from .handles import Enclosing, Handle, Stored, canonical, is_param_like, storage_ptr
from .keys import ModuleKeys
from .op_mode import DataMarks, OpMode, created_by_attention
from .pass_stats import PassStats, record_stats

__all__ = [
    "ACTIVATION_BITS",
    "FLOATS",
    "PROBABILITY_BITS",
    "SavedTensorHooks",
    "compress_saved_tensors",
    "scales_from_state",
]

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_RELU_NODES = frozenset({"ReluBackward0", "ReluBackward1"})
PROBABILITY_BITS = 4
"""The fewest bits of a saved softmax / sigmoid / tanh output (its backward is quadratic in
it)."""
ACTIVATION_BITS = 4
"""The fewest bits of a smooth activation's saved input on this route (its backward is
nonlinear in it: 2 bits there leave a bias that does not average out)."""
# outputs in a bounded range whose op computes its derivative from them: kept at
# PROBABILITY_BITS at least (a softmax's error enters its backward twice)
_PROBABILITY_NODES = frozenset(
    {"SoftmaxBackward0", "SafeSoftmaxBackward0", "SigmoidBackward0", "TanhBackward0"}
)
# log-probabilities: backward exponentiates them, so a rounding step becomes a factor
_EXACT_OUTPUT_NODES = frozenset({"LogSoftmaxBackward0"})
_MAX_SCALE_SITES = 1 << 16  # save sites whose scales are kept (all dropped past it)


def scales_from_state(state: Any) -> dict[str, ChannelScales]:
    """The save sites' channel scales of :meth:`SavedTensorHooks.scales_state` (checked)."""
    if not isinstance(state, dict):
        raise TypeError(f"channel scales state must be a dict, got {type(state).__name__}")
    return {str(key): ChannelScales.from_state_dict(value) for key, value in state.items()}


class SavedTensorHooks:
    """Pack/unpack hooks that compress saved tensors as a policy decides.

    Use it as a context manager (``with hooks: ...``); :func:`compress_saved_tensors` builds
    one. With ``model`` given, parameters/buffers are recognised by storage too (refreshed at
    every root forward) and each saved tensor gets a key that names the module that saved it
    (:class:`actcore.saved_tensors.keys.ModuleKeys`; without a model, ``"<outside>:i"`` from
    the block's entry), so bit plans do not depend on global forward order. ``kind_bits``:
    what graphs compiled under these hooks give each kind of input (a converted model's
    level; None: the policy's bits, :class:`~actcore.saved_tensors.graph_treatment.GraphPolicy`).
    """

    def __init__(
        self,
        policy: Any,
        *,
        model: nn.Module | None = None,
        min_numel: int = 1024,
        group_size: int = 256,
        exact_ops: bool = True,
        tailored: bool = False,
        router: Any = None,
        module_keys: bool = True,
        kind_bits: KindBits | None = None,
    ) -> None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        ops.api.check_group_size(group_size)
        self.policy = as_policy(policy)
        self.min_numel = min_numel
        self.group_size = group_size
        self.model: nn.Module | None = None
        self.stats: PassStats | None = None  # set by policies while estimating
        self.seeds: dict[str, int] | None = None  # fixed rounding seeds while estimating
        self.stream: Any = None  # an actcore.rng.SeedStream for the rounding seeds, or None
        self._param_ptrs: set[int] = set()
        self._dedup: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self._prune_at = 4096
        self._compressors: dict[tuple[int, bool], Compressor] = {}
        self._scales: dict[str, ChannelScales] = {}  # save site (key) -> its scales
        self._keys = ModuleKeys()
        self._local = threading.local()  # per thread: the active hooks and mode, suspensions
        self._warned_compiled = False
        self.exact_ops = bool(exact_ops)
        self.tailored = bool(tailored)
        self.router = AttentionRouter(self) if router is None else router
        self.module_keys = bool(module_keys)
        self.kind_bits = kind_bits
        if model is not None:
            self.attach(model)

    # ---- state ------------------------------------------------------------------------------

    def scales_state(self) -> dict[str, Any]:
        """Each save site's channel scales (for a resumed run to reuse them alike)."""
        return {key: scales.state_dict() for key, scales in self._scales.items()}

    def use_scales(self, scales: dict[str, ChannelScales]) -> None:
        """Take the save sites' scales of :func:`scales_from_state` (a resumed run's)."""
        self._scales = dict(scales)

    # ---- model bookkeeping ------------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        """Follow ``model``: parameter storages and (with ``module_keys``) module-scoped keys."""
        self.detach_model()
        self.model = model
        self.refresh_params()
        if self.module_keys:
            self._keys.attach(model, self.refresh_params)

    def detach_model(self) -> None:
        self._keys.detach()
        self.model = None
        self._param_ptrs = set()

    def refresh_params(self) -> None:
        """Re-read the storages of the model's parameters and buffers (after ``.to()``...)."""
        if self.model is not None:
            tensors: Iterable[Tensor] = (*self.model.parameters(), *self.model.buffers())
            self._param_ptrs = {p for p in map(storage_ptr, tensors) if p}

    # ---- context manager ---------------------------------------------------------------------

    def __enter__(self) -> SavedTensorHooks:
        if getattr(self._local, "hooks", None) is not None:
            raise RuntimeError("these saved-tensor hooks are already active")
        self._local.enclosing = self._enclosing()
        self._local.exact_states = []  # (a push left by a forward that raised is dropped)
        self._keys.restart_outside()
        if compiled.inlining_supported():
            # fx graphs: inlined into what torch.compile compiles, eager saves call self.pack
            compiled.push_owner(self)
            hooks = torch.autograd.graph.saved_tensors_hooks(
                *compiled.graph_hooks(self.graph_policy())
            )
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._local.hooks = hooks
        mode = OpMode(
            router=self.router,
            suspended=self.suspended,
            exact=self.exact_ops,
            marks=getattr(self._local, "marks", None) if self.tailored else None,
        )
        mode.recompute_attention = self.policy.compresses
        mode.recompute_derived = self.policy.compresses and self.kind_bits is not None
        mode.__enter__()
        self._local.mode = mode
        return self

    def __exit__(self, *exc: object) -> None:
        mode = getattr(self._local, "mode", None)
        hooks = getattr(self._local, "hooks", None)
        enclosing = getattr(self._local, "enclosing", None)
        self._local.mode = self._local.hooks = self._local.enclosing = None
        if enclosing is not None:
            enclosing.release()
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            if hooks is not None:
                hooks.__exit__(*exc)
            compiled.pop_owner(self)

    def graph_policy(self) -> GraphPolicy:
        """What the graphs inlined into compiled code apply: the policy's fixed bits (an
        adaptive policy's default bits: its per-tensor plan is keyed by eager saves), and
        ``kind_bits``, a converted model's bits by kind of input."""
        bits = getattr(self.policy, "bits", None) if self.policy.compresses else None
        if bits is None and self.policy.compresses:
            default = getattr(self.policy, "default_bits", None)
            bits = default() if default is not None else ACTIVATION_BITS
        return GraphPolicy(
            bits, self.min_numel, self.group_size, self.exact_ops, ACTIVATION_BITS, self.kind_bits
        )

    def passes_packings(self) -> bool:
        """Whether :meth:`pack` passes a Q-layer's packed tensors through untouched on this
        thread: no other hooks enclose these (see :meth:`_enclosing`)."""
        return getattr(self._local, "enclosing", None) is None

    def _enclosing(self) -> Enclosing | None:
        """The saved-tensor hooks active as these are pushed when they are another's (a
        user's, ``save_on_cpu``, a profiler's): PyTorch runs only the innermost hooks, so
        what these keep is handed on to those (:meth:`Handle.enclose`). Checkpoint's and
        actcore's own are not (checkpoint recomputes; actcore's tracker counts packings)."""
        top = stash.top_hooks()
        if top is None:
            return None
        pack = top[0]
        module = getattr(pack, "__module__", None) or ""
        ours = compiled.is_own_graph(pack) or module.split(".")[0] == "actcore"
        if ours or stash.is_checkpoint_hook(pack):
            return None
        return Enclosing(pack, top[1])

    def note_compiled_save(self) -> None:
        """A compiled graph packs with these hooks (inlined): enclosing hooks cannot reach
        what it saves, so warn, once."""
        enclosing = getattr(self._local, "enclosing", None)
        if enclosing is None or self._warned_compiled:
            return
        self._warned_compiled = True
        pack = enclosing.pack
        name = f"{getattr(pack, '__module__', '')}.{getattr(pack, '__qualname__', pack)}"
        warnings.warn(
            f"actcore: the saved-tensor hooks ({name}) around a compressed forward receive "
            "actcore's packings of eager saves only; the packings that graphs compiled by "
            "torch.compile save stay inside those graphs, out of their reach.",
            UserWarning,
            stacklevel=2,
        )

    @property
    def active(self) -> bool:
        """Whether the hooks are active on this thread."""
        return getattr(self._local, "hooks", None) is not None

    def suspend(self) -> None:
        """Keep what is saved from now on as it is (on this thread) until :meth:`resume`."""
        self._local.suspended = getattr(self._local, "suspended", 0) + 1

    def resume(self) -> None:
        self._local.suspended = max(0, getattr(self._local, "suspended", 0) - 1)

    def push_exact(self, exact: bool) -> None:
        """From now on (on this thread) keep what is saved as it is (``exact``) or compress
        it, until the matching :meth:`pop_exact`: the innermost push holds (a memory plan's
        choice for one block inside another's). :meth:`suspend` overrides it."""
        states = getattr(self._local, "exact_states", None)
        if states is None:
            states = self._local.exact_states = []
        states.append(bool(exact))

    def pop_exact(self) -> None:
        states = getattr(self._local, "exact_states", None)
        if states:
            states.pop()

    def suspended(self) -> bool:
        if getattr(self._local, "suspended", 0) > 0:
            return True
        states = getattr(self._local, "exact_states", None)
        return bool(states) and states[-1]

    # ---- hooks ------------------------------------------------------------------------------

    def _compressor(self, bits: int, swap: bool) -> Compressor:
        c = self._compressors.get((bits, swap))
        if c is None:
            c = Quantize(bits, self.group_size)
            if swap:
                c = Swap(c)
            self._compressors[(bits, swap)] = c
        return c

    def _passthrough(self, t: Tensor, note: bool, derivable: bool = True) -> Handle:
        """``t`` kept as it is; ``note``: counted as saved (not a parameter), and with
        ``derivable`` recorded as kept, for tensors derived from it to refer to."""
        h = Handle.kept(t)
        if note:
            memory.note_saved(h.tensor)
            if derivable and self.tailored and t.is_floating_point():
                stash.note_kept(t)  # a tensor derived from it may refer to it
        return h

    def _floored(self, t: Tensor, bits: int) -> int:
        """``bits``, raised where ``t`` is the input of the running call of
        :data:`actcore.saved_tensors.op_mode.FLOORED_INPUTS`: a batch norm's on few values
        per channel, a smooth activation's to :data:`ACTIVATION_BITS`."""
        mode = getattr(self._local, "mode", None)
        if mode is None or mode.floored_input == 0 or storage_ptr(t) != mode.floored_input:
            return bits
        if mode.floored_kind == "batch_norm":
            return max(bits, roles.batch_norm_bits(t)) if t.dim() >= 2 else bits
        return max(bits, ACTIVATION_BITS)

    def _keeps_exact(self, t: Tensor) -> bool:
        """What the op now saving needs exact (see :mod:`actcore.saved_tensors.op_mode`),
        log-probabilities (their backward exponentiates them: ``E[exp(q(x))] != exp(x)``), and, when
        ``tailored``, the float constants a forward makes outside the autograd graph (rotary
        cos/sin, position biases): anything without history that is not on one of the root
        forward's inputs."""
        mode = getattr(self._local, "mode", None)
        if mode is not None:
            if mode.depth:  # e.g. amax compares x == result
                return True
            if created_by_attention(mode, t, storage_ptr(t)):
                return True  # sdpa's logsumexp
        fn = t.grad_fn
        if fn is not None:
            return type(fn).__name__ in _EXACT_OUTPUT_NODES
        if not self.tailored or t.requires_grad or not t.is_floating_point():
            return False
        marks = getattr(self._local, "marks", None)
        return marks is not None and t not in marks

    def set_inputs(self, tensors: Iterable[Any]) -> None:
        """The root forward's tensor inputs on this thread. With ``tailored``, a tensor
        without autograd history is data when it derives from a floating input (followed
        through the ops the mode sees), else a constant of the forward, kept exact."""
        marks = DataMarks()
        for t in tensors:
            if isinstance(t, Tensor) and t.is_floating_point():
                marks.add(t)
        self._local.marks = marks

    def pack(self, t: Tensor) -> Handle:
        """The pack hook: what :meth:`compress` keeps, handed on to enclosing hooks."""
        h = self.compress(t)
        enclosing = getattr(self._local, "enclosing", None)
        if enclosing is not None and isinstance(h, Handle):
            h.enclose(enclosing, t)
        return h

    def compress(self, t: Tensor) -> Handle:
        """A handle on ``t``: kept as it is or packed, by policy and kind."""
        if not isinstance(t, Tensor):
            return t
        kind = stash.stashed_kind(t)
        if kind == stash.PACKED:  # a Q-layer's packing: counted, nothing else to look up
            return self._passthrough(t, note=True, derivable=False)
        if kind is not None:  # a Q-layer keeps it exact
            return self._passthrough(t, note=not is_param_like(t, self._param_ptrs))
        if t.layout != torch.strided or t.is_nested:  # sparse, nested: kept as they are
            return self._passthrough(t, note=not is_param_like(t, self._param_ptrs))
        if is_param_like(t, self._param_ptrs):
            return self._passthrough(t, note=False)
        if self.suspended() or not self.policy.compresses or self._keeps_exact(t):
            return self._passthrough(t, note=True)
        small = t.numel() < self.min_numel
        if small or not (t.dtype in FLOATS or t.dtype == torch.bool) or t.device.type == "meta":
            return self._passthrough(t, note=True)
        key = self._keys.next_key()
        bits = None
        if t.dtype != torch.bool:
            bits = self.policy.bits_for(key)
            if bits is None:
                return self._passthrough(t, note=True)
            fn = t.grad_fn
            if fn is not None and type(fn).__name__ in _PROBABILITY_NODES:
                bits = max(bits, PROBABILITY_BITS)
            bits = self._floored(t, bits)
        with torch.no_grad():
            return self._pack_compressed(t, key, bits)

    def _reuse(self, t: Tensor, earlier: Packing, base: Tensor | None = None) -> Handle:
        """A handle on an earlier packing of ``t`` (or of ``base``, ``t`` being a view of it:
        the restored base is viewed as ``t`` again)."""
        if base is None:
            h = Handle.packed(t, t.shape, tuple(range(t.dim())))
        else:
            offset = t.storage_offset() - base.storage_offset()
            view = (tuple(t.shape), tuple(t.stride()), offset)
            h = Handle.packed(t, base.shape, tuple(range(base.dim())), view=view)
        h.stored = Stored(earlier)
        restoring.expect(earlier)
        return h

    def _pack_compressed(self, t: Tensor, key: str, bits: int | None) -> Handle:
        canon, inv, expand = canonical(t)
        h = Handle.packed(t, canon.shape, inv, expand)
        dkey = (
            storage_ptr(canon),
            canon.storage_offset(),
            tuple(canon.shape),
            tuple(canon.stride()),
            canon.dtype,
            str(canon.device),
            t._version,
        )
        hit = self._dedup.get(dkey)
        if hit is not None:
            src, stored = hit[0](), hit[1]()
            if src is not None and stored is not None and src._version == t._version:
                h.stored = stored
                restoring.expect(stored.packing)
                return h
        if bits is not None:  # a Q-layer packed this very tensor, or what it views
            earlier = stash.packing_of(t)
            if earlier is not None:
                return self._reuse(t, earlier)
            base = t._base
            if base is not None and base.is_contiguous() and base.dtype == t.dtype:
                earlier = stash.packing_of(base)
                if earlier is not None:
                    return self._reuse(t, earlier, base)
        data = canon.contiguous()
        plain = expand is None and inv == tuple(range(t.dim()))  # canon is t's own layout
        mask = None
        if bits is None:
            comp: Compressor = MaskBits()
        else:
            seeds = self.seeds
            if seeds is not None:
                comp = SeededQuantize(bits, self.group_size, seed=seeds.get(key, 0))
            else:
                comp = self._compressor(bits, self.policy.swap)
            known = stash.mask_of(t) if plain else None
            fn = t.grad_fn
            if known is not None:  # a ReLU's own 1-bit mask: keep the nonzeros only
                comp = ZeroValue(known, Quantize(bits, self.group_size, per_sample=False))
            else:  # outlier channels apart (some exact: backward may be nonlinear in t)
                comp = self._channel_scaled(comp, t, data, inv, key)
                if fn is not None and type(fn).__name__ in _RELU_NODES:
                    mask = ops.pack_mask(data != 0)
        with rng.using(self.stream):
            tensors, meta = comp.pack(data)
        stored = Stored(Packing(comp, tuple(tensors), meta), mask)
        h.stored = stored
        restoring.expect(stored.packing)
        if plain and mask is None and comp.lossy:  # a Q-layer saving t later reuses it
            stash.remember_packing(t, comp, tuple(tensors), meta)
        if self.stats is not None and bits is not None:
            inner = tensors[: meta[1]] if isinstance(comp, ChannelScaled) else tensors
            self._record_stats(key, bits, data.numel(), inner, meta)
        if h.ref is not None:
            self._dedup[dkey] = (h.ref, weakref.ref(stored))
            if len(self._dedup) > self._prune_at:
                self._prune()
        memory.note_saved([*stored.packing.tensors, *(() if mask is None else (mask,))])
        return h

    def _channel_scaled(
        self, comp: Compressor, t: Tensor, data: Tensor, inv: tuple[int, ...], key: str
    ) -> Compressor:
        """``comp`` with ``data``'s outlier channels apart, the largest exact: for sdpa's q
        and k the feature dims both keep exact (:func:`actcore.layers.attention.shared_exact_dims`),
        while the features stay the last dim in memory order. Elsewhere the save site
        ``key`` reuses its scales and exact channels between refreshes
        (:meth:`~actcore.compressors.channel_scaled.ChannelScales.due`)."""
        dims = shared_exact_dims(t)
        if dims is not None and inv[-1] == t.dim() - 1:
            return ChannelScaled(comp, -1, exact=dims.numel(), top=dims)
        site = self._scales.get(key)
        if site is None:
            if len(self._scales) >= _MAX_SCALE_SITES:
                self._scales.clear()
            site = self._scales[key] = ChannelScales()
        return scaled(comp, data, self.group_size, True, scales=site, refresh=site.due())

    def _record_stats(self, key: str, bits: int, numel: int, tensors: Any, meta: Any) -> None:
        assert self.stats is not None
        record_stats(self.stats, key, bits, numel, tensors, self.group_size)

    def _prune(self) -> None:
        dead = [k for k, (a, b) in self._dedup.items() if a() is None or b() is None]
        for k in dead:
            del self._dedup[k]
        self._prune_at = max(4096, 2 * len(self._dedup))  # amortised O(1) per save

    def unpack(self, h: Any) -> Tensor:
        """The unpack hook."""
        return h.restore() if isinstance(h, Handle) else h


def compress_saved_tensors(
    policy: Any = "G1",
    *,
    model: nn.Module | None = None,
    min_numel: int = 1024,
    group_size: int = 256,
    exact_ops: bool = True,
) -> SavedTensorHooks:
    """Compress the tensors autograd saves inside a ``with`` block; no model needed.

    Args:
        policy: a level name of :data:`actcore.config.HOOK_LEVELS` (``"G0"`` .. ``"G3"``),
            a number of bits (1..8), or a :class:`actcore.policies.Policy`.
        model: optional; its parameters/buffers are recognised by storage and keys name
            modules (adaptive policies need :class:`actcore.Controller` to adapt).
        min_numel: tensors with fewer elements are kept as they are.
        group_size: quantization group size (a positive multiple of 8).
        exact_ops: keep the tensors saved by ops that compare or divide saved values exact
            (see :mod:`actcore.saved_tensors.exact_ops`); ``False`` quantizes them too (their
            gradients are then wrong: only for measuring what that costs).
    """
    return SavedTensorHooks(
        policy, model=model, min_numel=min_numel, group_size=group_size, exact_ops=exact_ops
    )
