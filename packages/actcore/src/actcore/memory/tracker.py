"""The tracker behind :func:`actcore.memory.track`: storages recorded while they are held
for backward, attributed to the running module, walked from each module's outputs."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.utils.hooks import RemovableHandle

from . import saved_hooks
from .graph import NO_SEQ, compiling_now, grad_fns, next_seq
from .report import OUTSIDE, MemoryReport
from .saved_hooks import ACTIVE_TRACKERS, hooks_state, pack_hook, unpack_hook
from .storage import is_param, iter_tensors, sparse_parts, storage_of

__all__ = ["Tracker"]


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
        self._entry_seq = next_seq() or 0
        model = self.model
        if model is not None:
            tensors = [*model.parameters(), *model.buffers()]
            self._param_keys = {storage_of(t)[0] for t in tensors}
            for order, (name, module) in enumerate(model.named_modules()):
                self._names[name] = order
                self.report.module_types[name] = type(module).__name__
                self._hook_module(name, module)
        self._start_cuda()
        state = hooks_state()
        if state == "none":
            self._pushed = torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook)
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
        ACTIVE_TRACKERS.append(self)

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
            if self in ACTIVE_TRACKERS:
                ACTIVE_TRACKERS.remove(self)
            if self._pushed is not None:
                pushed, self._pushed = self._pushed, None
                if saved_hooks._TOP_HOOKS is not None and hooks_state() != "own":
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
        for tracker in ACTIVE_TRACKERS:  # keep enclosing trackers' peaks across our reset
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
        parts = sparse_parts(t)
        if parts is not None:
            for part in parts:
                self._record(part, holder, owner)
            return
        key, nbytes = storage_of(t)
        if not self.include_params and (key in self._param_keys or is_param(t)):
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

    def _moved(self, old_key: Any, t: Tensor) -> None:
        """``t``, counted under ``old_key``, now has another storage (cut to size in place)."""
        entry = self._by_key.pop(old_key, None)
        if entry is None:
            return
        key, nbytes = storage_of(t)
        if entry.live > 0:
            self._current += nbytes - entry.nbytes
        entry.nbytes = nbytes
        self._by_key[key] = entry

    def _record_ctx(self, node: Any, owner: str) -> None:
        """Record the tensors a custom Function keeps as ``ctx`` attributes."""
        for value in list(vars(node).values()):
            for t in iter_tensors(value):
                for tracker in ACTIVE_TRACKERS:
                    tracker._record(t, t, owner if tracker is self else None)

    # ---- module hooks and graph walks -------------------------------------------------------

    def _pre_hook(self, name: str, module: nn.Module, args: Any) -> None:
        if compiling_now():
            return
        parent = self._frames[-1].start if self._frames else self._entry_seq
        start = next_seq()
        self._frames.append(_Frame(name, parent if start is None else start))

    def _post_hook(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if compiling_now():
            return
        for i in range(len(self._frames) - 1, -1, -1):
            if self._frames[i].name == name:
                frame = self._frames[i]
                del self._frames[i:]
                break
        else:
            return
        self._walk([*grad_fns(output), *frame.boundary], frame.start, frame.name)

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
            if seq == NO_SEQ or seq in visited or seq < self._entry_seq:
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
            self._walk(list(grad_fns(outputs)), frame.start, frame.name)
        else:
            self._walk(list(grad_fns(outputs)), self._entry_seq, self._owner())
