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

from .api import measure, note_held, note_moved, note_outputs, note_saved, storage_key, track
from .profiler import profiled_bytes, profiled_peak_bytes
from .report import OUTSIDE, MemoryReport, format_bytes
from .tracker import Tracker

__all__ = [
    "OUTSIDE",
    "MemoryReport",
    "Tracker",
    "format_bytes",
    "measure",
    "note_held",
    "note_moved",
    "note_outputs",
    "note_saved",
    "profiled_bytes",
    "profiled_peak_bytes",
    "storage_key",
    "track",
]
