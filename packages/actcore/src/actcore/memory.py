"""Memory accounting: the bytes autograd keeps for backward.

``track(model)`` is a context manager that counts the storages a forward pass leaves held for
backward, deduplicated by storage, with a per-module breakdown, on any device (CPU included)::

    with actcore.memory.track(model) as report:
        out = model(x)
    print(report)                 # per-module table
    report.retained_bytes         # int

What is counted, and how:

* Tensors that autograd saves (built-in ops and ``ctx.save_for_backward``) are seen by a pair of
  identity saved-tensor hooks that the tracker installs, **only when no other saved-tensor hooks
  are active** at entry. If hooks are already active (e.g. actcore's compression hooks), the
  tracker leaves them alone and counts what they report through :func:`note_saved`; hooks that
  never call :func:`note_saved` are invisible to it (``report.hooks`` says which case applied).
* Tensors kept as attributes of a custom ``autograd.Function``'s ``ctx`` (tensors, containers
  of tensors, objects with a ``tensors()`` method such as actcore's ``Packed``) are found by
  walking the autograd graph behind each tracked module's outputs (and behind what is passed to
  :func:`note_outputs`). The C++ nodes' ``_saved_*`` attributes are never read: that would run
  the active unpack hook (and decompress).
* A saved view counts its whole storage: it keeps the whole storage alive.
* Parameters and buffers of ``model`` (and any ``nn.Parameter`` or view of one, such as the
  ``weight.t()`` that ``linear`` saves) are not activations and are excluded unless
  ``include_params=True``. Inputs of the model that autograd saves (e.g. the input of the first
  conv) do count: autograd keeps them alive for backward.

``retained_bytes`` is what is still held for backward when the block exits (what the forward
leaves behind). Liveness is followed with weak references, so a forward and backward in the
same block leave ``retained_bytes == 0`` while ``peak_bytes`` shows the most held at once and
``saved_bytes`` the total saved, and a storage address reused after a free is not mistaken for
the same storage. On CUDA the report also gives ``cuda_peak_delta``, from
``torch.cuda.max_memory_allocated`` (the tracker resets that peak statistic on entry).

The tracker does not change outputs or gradients. Because saved-tensor hooks turn off autograd's
own version-counter check, the tracker's unpack hook repeats that check, so an in-place change
of a saved tensor still raises the usual ``RuntimeError`` in backward. It is meant for eager
mode on one thread: module hooks do nothing while ``torch.compile`` traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.utils.hooks import RemovableHandle

__all__ = [
    "OUTSIDE",
    "MemoryReport",
    "Tracker",
    "format_bytes",
    "measure",
    "note_outputs",
    "note_saved",
    "profiled_bytes",
    "track",
]

OUTSIDE = "<outside>"
"""``by_module`` key for bytes saved inside the block but outside every tracked module."""

_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad and other graph leaves
_MAX_DEPTH = 8  # how deep note_saved / ctx walking looks into nested containers

# Active trackers, outermost first. Every recorded tensor goes to all of them.
_ACTIVE: list[Tracker] = []

# torch >= 2.8 can read the saved-tensor hook stack; older torch is probed (see _hooks_state).
_TOP_HOOKS: Callable[..., Any] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None
)
_HOOKS_ENABLED: Callable[[], bool] | None = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", None
)


def format_bytes(n: int) -> str:
    """Human-readable byte count with binary units, e.g. ``1536 -> '1.50 KiB'``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = abs(n) / 1024.0
    units = ["KiB", "MiB", "GiB", "TiB", "PiB"]
    while value >= 1024.0 and len(units) > 1:
        value /= 1024.0
        units.pop(0)
    return f"{'-' if n < 0 else ''}{value:.2f} {units[0]}"


@dataclasses.dataclass
class MemoryReport:
    """What a :func:`track` block left held for backward (filled in when the block exits).

    Attributes:
        retained_bytes: bytes held for backward at exit, each storage counted once.
        by_module: ``retained_bytes`` split by qualified module name (``""`` is the root
            module, :data:`OUTSIDE` is outside every tracked module); modules holding
            nothing are left out; the values sum to ``retained_bytes``.
        by_device: ``retained_bytes`` split by device (``"cpu"``, ``"cuda:0"``, ...), e.g.
            to tell GPU activations from host copies made by a CPU-swap compressor.
        num_tensors: saved tensors recorded during the block (references, before dedup).
        num_storages: distinct storages behind ``retained_bytes``.
        peak_bytes: the most bytes held for backward at one time during the block.
        saved_bytes: bytes saved during the block in total (each storage once per stay).
        cuda_peak_delta: on CUDA, ``max_memory_allocated`` during the block minus
            ``memory_allocated`` at entry; ``None`` off CUDA.
        hooks: how saved tensors were seen: ``"own"`` (the tracker's hooks, or an enclosing
            tracker's), ``"foreign"`` (other hooks active: only :func:`note_saved` reports),
            ``"disabled"`` (saved-tensor hooks disabled: only ``ctx`` attributes and
            :func:`note_saved`).
        module_types: class name of each tracked module, by qualified name.
    """

    retained_bytes: int = 0
    by_module: dict[str, int] = dataclasses.field(default_factory=dict)
    by_device: dict[str, int] = dataclasses.field(default_factory=dict)
    num_tensors: int = 0
    num_storages: int = 0
    peak_bytes: int = 0
    saved_bytes: int = 0
    cuda_peak_delta: int | None = None
    hooks: str = "own"
    module_types: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    def table(self) -> str:
        """A readable per-module breakdown of ``retained_bytes``."""
        rows = []
        for name, nbytes in self.by_module.items():
            label = name or "(root)"
            if name in self.module_types:
                label = f"{label} ({self.module_types[name]})"
            share = 100.0 * nbytes / self.retained_bytes if self.retained_bytes else 0.0
            rows.append((label, format_bytes(nbytes), f"{share:.1f}%"))
        rows.append(("total", format_bytes(self.retained_bytes), "100.0%" if rows else "-"))
        w0 = max(len("module"), *(len(r[0]) for r in rows))
        w1 = max(len("held"), *(len(r[1]) for r in rows))
        lines = [
            f"Held for backward: {format_bytes(self.retained_bytes)} in {self.num_storages} "
            f"storage(s); peak {format_bytes(self.peak_bytes)}, "
            f"saved in total {format_bytes(self.saved_bytes)}",
            f"{'module':<{w0}}  {'held':>{w1}}  share",
        ]
        lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>5}" for a, b, c in rows]
        if len(self.by_device) > 1:
            per = ", ".join(f"{d} {format_bytes(b)}" for d, b in self.by_device.items())
            lines.append(f"by device: {per}")
        if self.cuda_peak_delta is not None:
            lines.append(f"CUDA peak over entry: {format_bytes(self.cuda_peak_delta)}")
        if self.hooks != "own":
            lines.append(
                f"note: saved-tensor hooks were {self.hooks}; counted only ctx attributes and "
                "note_saved() reports"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------------------------
# Storage identity
# --------------------------------------------------------------------------------------------


def _storage_of(t: Tensor) -> tuple[Any, int]:
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


def _sparse_parts(t: Tensor) -> tuple[Tensor, ...] | None:
    """The dense tensors a sparse tensor is made of (None for a strided or other tensor)."""
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    names = _COMPRESSED_SPARSE.get(t.layout)
    if names is None:
        return None
    return (*(getattr(t, n)() for n in names), t.values())


def _is_param(t: Tensor) -> bool:
    """True for an ``nn.Parameter`` or a view of one (e.g. ``weight.t()``)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _iter_tensors(obj: Any, depth: int = 0) -> Iterator[Tensor]:
    """Tensors in ``obj``: a tensor, containers of them, objects with ``tensors()``."""
    if isinstance(obj, Tensor):
        yield obj
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from _iter_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item, depth + 1)
    elif not isinstance(obj, (nn.Module, type)):
        tensors = getattr(obj, "tensors", None)
        if callable(tensors):
            yield from _iter_tensors(tensors(), depth + 1)


# --------------------------------------------------------------------------------------------
# The tracker's saved-tensor hooks
# --------------------------------------------------------------------------------------------


class _Saved:
    """What the tracker's pack hook stores: a detached alias and the version at save time."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


_PROBE: dict[str, Any] = {"leaf": None, "running": False, "seen": False}


def _pack_hook(t: Tensor) -> _Saved:
    """Record ``t`` in every active tracker; keep a detached alias (no reference cycle)."""
    alias = t.detach()
    if _PROBE["running"] and t is _PROBE["leaf"]:
        _PROBE["seen"] = True
    else:
        for tracker in _ACTIVE:
            tracker._record(t, alias)
    return _Saved(alias, t._version)


def _unpack_hook(saved: _Saved) -> Tensor:
    """Return the alias, after autograd's own in-place check (hooks turn that check off)."""
    t = saved.tensor
    if t._version != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {saved.version} instead. (Seen by actcore.memory's saved-tensor "
            "hooks; enable anomaly detection with torch.autograd.set_detect_anomaly(True) to "
            "find the operation that failed to compute its gradient.)"
        )
    return t


def _hooks_state() -> str:
    """Which saved-tensor hooks are on top now: 'none', 'own', 'foreign' or 'disabled'."""
    if _HOOKS_ENABLED is not None and not _HOOKS_ENABLED():
        return "disabled"
    if _TOP_HOOKS is not None:
        try:
            top = _TOP_HOOKS(True)
        except TypeError:  # a build whose accessor takes no argument
            top = _TOP_HOOKS()
        if top is None:
            return "none"
        return "own" if top[0] is _pack_hook else "foreign"
    return _probe_hooks()


def _probe_hooks() -> str:
    """Find the top hooks on torch < 2.8 by saving a one-element tensor (never unpacked)."""
    if torch.is_inference_mode_enabled():
        return "foreign"  # cannot tell; never override hooks we cannot see
    if _PROBE["leaf"] is None:
        _PROBE["leaf"] = torch.zeros(1, requires_grad=True)
    leaf = _PROBE["leaf"]
    _PROBE["running"], _PROBE["seen"] = True, False
    try:
        with torch.enable_grad():
            out = leaf.mul(leaf)
    except Exception:
        return "foreign"
    finally:
        _PROBE["running"] = False
    if _PROBE["seen"]:
        return "own"
    try:  # raises when the saved tensor already went through (foreign) default hooks
        out.grad_fn._raw_saved_self.register_hooks(torch.Tensor.detach, lambda x: x)
    except RuntimeError:
        return "foreign"
    return "none"


_SEQ_LEAF: list[Tensor] = []


def _next_seq() -> int | None:
    """Sequence number of a fresh autograd node: every later node gets a larger one."""
    if not _SEQ_LEAF:
        _SEQ_LEAF.append(torch.empty(0, requires_grad=True))
    leaf = _SEQ_LEAF[0]
    with torch.enable_grad():
        node = leaf.view_as(leaf).grad_fn
    return None if node is None else node._sequence_nr()


def _is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn is not None and fn())


def _grad_fns(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Autograd nodes behind the tensors of a (nested) output."""
    for t in _iter_tensors(obj, depth):
        if t.grad_fn is not None:
            yield t.grad_fn


# --------------------------------------------------------------------------------------------
# Tracker
# --------------------------------------------------------------------------------------------


class _Entry:
    """One storage held for backward, alive while any tensor recorded for it is alive."""

    __slots__ = ("device", "live", "module", "nbytes", "refs", "tracker")

    def __init__(self, tracker: Tracker, nbytes: int, module: str, device: str) -> None:
        self.tracker: Tracker | None = tracker
        self.nbytes = nbytes
        self.module = module
        self.device = device
        self.live = 0
        self.refs: list[weakref.ref] = []

    def watch(self, holder: Tensor) -> None:
        with contextlib.suppress(TypeError):  # not weak-referenceable: held until exit
            self.refs.append(weakref.ref(holder, self._dead))
        self.live += 1

    def _dead(self, _ref: weakref.ref) -> None:
        self.live -= 1
        if self.live == 0 and self.tracker is not None:
            self.tracker._current -= self.nbytes


class _Frame:
    """A running tracked module: its name, first sequence number and nodes left to its parent."""

    __slots__ = ("boundary", "name", "start")

    def __init__(self, name: str, start: int) -> None:
        self.name = name
        self.start = start
        self.boundary: list[Any] = []


class Tracker:
    """Context manager behind :func:`track`; ``with`` yields its :class:`MemoryReport`."""

    def __init__(self, model: nn.Module | None = None, *, include_params: bool = False) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        self.model = model
        self.include_params = include_params
        self.report = MemoryReport()
        self._used = False
        self._frames: list[_Frame] = []
        self._entries: list[_Entry] = []
        self._by_key: dict[Any, _Entry] = {}
        self._visited: set[int] = set()
        self._param_keys: set[Any] = set()
        self._handles: list[RemovableHandle] = []
        self._names: dict[str, int] = {}
        self._entry_seq = 0
        self._current = 0
        self._peak = 0
        self._pushed: torch.autograd.graph.saved_tensors_hooks | None = None
        self._cuda_device: torch.device | None = None
        self._cuda_base = 0
        self._cuda_carry = 0

    # ---- entry / exit -----------------------------------------------------------------------

    def __enter__(self) -> MemoryReport:
        if self._used:
            raise RuntimeError("a memory Tracker can be entered only once; call track() again")
        self._used = True
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self.report

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _setup(self) -> None:
        self._entry_seq = _next_seq() or 0
        model = self.model
        if model is not None:
            tensors = [*model.parameters(), *model.buffers()]
            self._param_keys = {_storage_of(t)[0] for t in tensors}
            for order, (name, module) in enumerate(model.named_modules()):
                self._names[name] = order
                self.report.module_types[name] = type(module).__name__
                self._hook_module(name, module)
        self._start_cuda()
        state = _hooks_state()
        if state == "none":
            self._pushed = torch.autograd.graph.saved_tensors_hooks(_pack_hook, _unpack_hook)
            self._pushed.__enter__()
            state = "own"
        elif state == "disabled":
            warnings.warn(
                "actcore.memory.track: saved-tensor hooks are disabled here, so only ctx "
                "attributes and note_saved() reports are counted",
                RuntimeWarning,
                stacklevel=3,
            )
        self.report.hooks = state
        _ACTIVE.append(self)

    def _hook_module(self, name: str, module: nn.Module) -> None:
        """Register the attribution hooks; a module that refuses them (TorchScript) is skipped."""
        try:
            pre = module.register_forward_pre_hook(functools.partial(self._pre_hook, name))
        except (RuntimeError, TypeError, AttributeError):
            return  # its saves go to the enclosing tracked module
        self._handles.append(pre)
        post = functools.partial(self._post_hook, name)
        self._handles.append(module.register_forward_hook(post, always_call=True))

    def _teardown(self) -> None:
        try:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if self._pushed is not None:
                pushed, self._pushed = self._pushed, None
                if _TOP_HOOKS is not None and _hooks_state() != "own":
                    warnings.warn(
                        "actcore.memory.track: the saved-tensor hooks on top at exit are not "
                        "the tracker's (hooks pushed in the block were not popped)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                pushed.__exit__()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._frames.clear()
            self._finish()

    def _start_cuda(self) -> None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = None
        if self.model is not None:
            for t in (*self.model.parameters(), *self.model.buffers()):
                if t.is_cuda:
                    device = t.device
                    break
            else:
                if any(True for _ in self.model.parameters()):
                    return  # a model off CUDA: no CUDA figure
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for tracker in _ACTIVE:  # keep enclosing trackers' peaks across our reset
            if tracker._cuda_device == device:
                peak = torch.cuda.max_memory_allocated(device)
                tracker._cuda_carry = max(tracker._cuda_carry, peak)
        self._cuda_device = device
        self._cuda_base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def _finish(self) -> None:
        rep = self.report
        if self._cuda_device is not None:
            peak = max(self._cuda_carry, torch.cuda.max_memory_allocated(self._cuda_device))
            rep.cuda_peak_delta = peak - self._cuda_base
        by_module: dict[str, int] = {}
        by_device: dict[str, int] = {}
        retained = storages = 0
        for entry in self._entries:
            rep.saved_bytes += entry.nbytes
            if entry.live > 0:
                retained += entry.nbytes
                storages += 1
                by_module[entry.module] = by_module.get(entry.module, 0) + entry.nbytes
                by_device[entry.device] = by_device.get(entry.device, 0) + entry.nbytes
            entry.tracker = None
            entry.refs.clear()
        rep.retained_bytes = retained
        rep.by_device = {d: by_device[d] for d in sorted(by_device) if by_device[d] > 0}
        rep.num_storages = storages
        rep.peak_bytes = self._peak
        order = self._names
        rep.by_module = {
            k: by_module[k]
            for k in sorted(by_module, key=lambda k: (order.get(k, len(order)), k))
            if by_module[k] > 0
        }
        self._entries = []
        self._by_key = {}
        self._visited = set()

    # ---- recording --------------------------------------------------------------------------

    def _owner(self) -> str:
        if self._frames:
            return self._frames[-1].name
        return OUTSIDE if self.model is not None else ""

    def _record(self, t: Tensor, holder: Tensor, owner: str | None = None) -> None:
        """Count ``t``'s storage once while ``holder`` (what keeps it for backward) lives.

        A sparse tensor is counted as its indices and values (each storage once).
        """
        parts = _sparse_parts(t)
        if parts is not None:
            for part in parts:
                self._record(part, holder, owner)
            return
        key, nbytes = _storage_of(t)
        if not self.include_params and (key in self._param_keys or _is_param(t)):
            return
        self.report.num_tensors += 1
        entry = self._by_key.get(key)
        if entry is not None and entry.live > 0:
            if nbytes > entry.nbytes:  # same address, larger storage (rare): keep the larger
                self._current += nbytes - entry.nbytes
                entry.nbytes = nbytes
                self._peak = max(self._peak, self._current)
            entry.watch(holder)
            return
        entry = _Entry(self, nbytes, owner if owner is not None else self._owner(), str(t.device))
        entry.watch(holder)
        self._entries.append(entry)
        self._by_key[key] = entry
        self._current += nbytes
        self._peak = max(self._peak, self._current)

    def _record_ctx(self, node: Any, owner: str) -> None:
        """Record the tensors a custom Function keeps as ``ctx`` attributes."""
        for value in list(vars(node).values()):
            for t in _iter_tensors(value):
                for tracker in _ACTIVE:
                    tracker._record(t, t, owner if tracker is self else None)

    # ---- module hooks and graph walks -------------------------------------------------------

    def _pre_hook(self, name: str, module: nn.Module, args: Any) -> None:
        if _is_compiling():
            return
        parent = self._frames[-1].start if self._frames else self._entry_seq
        start = _next_seq()
        self._frames.append(_Frame(name, parent if start is None else start))

    def _post_hook(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if _is_compiling():
            return
        for i in range(len(self._frames) - 1, -1, -1):
            if self._frames[i].name == name:
                frame = self._frames[i]
                del self._frames[i:]
                break
        else:
            return
        self._walk([*_grad_fns(output), *frame.boundary], frame.start, frame.name)

    def _walk(self, roots: list[Any], cutoff: int, owner: str) -> None:
        """Visit nodes created since ``cutoff`` behind ``roots``; older ones go to the parent."""
        boundary: list[Any] = []
        stack = list(roots)
        visited = self._visited
        while stack:
            node = stack.pop()
            try:
                seq = node._sequence_nr()
            except (AttributeError, RuntimeError):
                continue
            if seq == _NO_SEQ or seq in visited or seq < self._entry_seq:
                continue
            if seq < cutoff:
                boundary.append(node)
                continue
            visited.add(seq)
            if isinstance(node, BackwardCFunction):
                self._record_ctx(node, owner)
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        if not boundary:
            return
        if self._frames:
            self._frames[-1].boundary.extend(boundary)
        elif cutoff > self._entry_seq:
            self._walk(boundary, self._entry_seq, self._owner())

    def _note_outputs(self, outputs: Any) -> None:
        if self._frames:
            frame = self._frames[-1]
            self._walk(list(_grad_fns(outputs)), frame.start, frame.name)
        else:
            self._walk(list(_grad_fns(outputs)), self._entry_seq, self._owner())


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def track(model: nn.Module | None = None, *, include_params: bool = False) -> Tracker:
    """Count what autograd keeps for backward inside a ``with`` block.

    Args:
        model: module whose submodules get a per-module breakdown and whose parameters and
            buffers are excluded; with ``None`` everything is reported under ``""`` and only
            ``nn.Parameter`` tensors (and their views) are excluded.
        include_params: also count parameters and buffers that autograd saves.

    Returns:
        A context manager; ``with track(model) as report:`` gives a :class:`MemoryReport`
        that is filled in when the block exits. Trackers nest; each counts everything.
    """
    return Tracker(model, include_params=include_params)


def note_saved(obj: Any) -> None:
    """Report data a saved-tensor hook or compressor keeps for backward to active trackers.

    ``obj`` is a tensor, an object with a ``tensors()`` method (e.g. actcore's ``Packed``), or
    a list/tuple/dict of those. Call it from a pack hook with what the hook returns. It does
    nothing when no tracker is active.
    """
    if not _ACTIVE or _PROBE["running"]:
        return
    for t in _iter_tensors(obj):
        for tracker in _ACTIVE:
            tracker._record(t, t)


def note_outputs(outputs: Any) -> None:
    """Walk the autograd graph behind ``outputs`` for tensors kept as ``ctx`` attributes.

    Module outputs are walked automatically; call this for results computed outside tracked
    modules (e.g. with ``track()`` and no model). Does nothing when no tracker is active.
    """
    if _ACTIVE and not _is_compiling():
        for tracker in list(_ACTIVE):
            tracker._note_outputs(outputs)


def measure(
    fn: Callable[..., Any], *args: Any, include_params: bool = False, **kwargs: Any
) -> tuple[Any, MemoryReport]:
    """Run ``fn(*args, **kwargs)`` under :func:`track` and return ``(output, report)``.

    When ``fn`` is an ``nn.Module`` it is the tracked model. Keep the output alive for as long
    as the graph should be: it holds what the report counts.
    """
    model = fn if isinstance(fn, nn.Module) else None
    with track(model, include_params=include_params) as report:
        output = fn(*args, **kwargs)
        note_outputs(output)
    return output, report


def profiled_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the bytes it left allocated, counted by the profiler.

    An independent measure (it never looks at saved tensors): the sum of the self memory
    over the events of ``torch.profiler.profile(profile_memory=True)``, i.e. allocations
    minus frees during the call, on the CPU (``self_cpu_memory_usage``), or on CUDA
    (``self_device_memory_usage``) when any argument is a CUDA tensor. Around a forward it
    is what the forward saved for backward plus its output, minus saved tensors that were
    allocated before the call (such as the input).
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    cuda = any(isinstance(a, Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    gc.collect()
    with profile(activities=activities, profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    field_name = "self_device_memory_usage" if cuda else "self_cpu_memory_usage"
    return out, sum(getattr(e, field_name, 0) or 0 for e in prof.events())
