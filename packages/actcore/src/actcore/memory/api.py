"""The public entry points of :mod:`actcore.memory`: :func:`track`, :func:`measure`, and the
reports (:func:`note_saved`, :func:`note_outputs`) that other saved-tensor hooks and
custom code make to active trackers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .graph import compiling_now
from .report import MemoryReport
from .saved_hooks import ACTIVE_TRACKERS, PROBE
from .storage import iter_tensors, storage_of
from .tracker import Tracker

__all__ = [
    "measure",
    "note_held",
    "note_moved",
    "note_outputs",
    "note_saved",
    "storage_key",
    "track",
]


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
    if not ACTIVE_TRACKERS or PROBE["running"]:
        return
    for t in iter_tensors(obj):
        for tracker in ACTIVE_TRACKERS:
            tracker._record(t, t)


def note_held(t: Tensor, holder: Tensor) -> None:
    """Report to active trackers that ``t`` is kept for backward for as long as ``holder``
    lives (something attached to ``holder`` refers to ``t``), not longer: it is counted
    while ``holder`` is alive. Does nothing when no tracker is active."""
    if not ACTIVE_TRACKERS or PROBE["running"]:
        return
    for tracker in ACTIVE_TRACKERS:
        tracker._record(t, holder)


def storage_key(t: Tensor) -> Any:
    """What :func:`note_moved` takes: ``t``'s storage as the trackers know it."""
    return storage_of(t)[0]


def note_moved(t: Tensor, before: Any) -> None:
    """Tell active trackers that ``t``, saved for backward, now has another storage (its
    storage replaced in place, e.g. cut to size); ``before``: :func:`storage_key` of ``t``
    taken before the change. Does nothing when no tracker is active."""
    for tracker in list(ACTIVE_TRACKERS):
        tracker._moved(before, t)


def note_outputs(outputs: Any) -> None:
    """Walk the autograd graph behind ``outputs`` for tensors kept as ``ctx`` attributes.

    Module outputs are walked automatically; call this for results computed outside tracked
    modules (e.g. with ``track()`` and no model). Does nothing when no tracker is active.
    """
    if ACTIVE_TRACKERS and not compiling_now():
        for tracker in list(ACTIVE_TRACKERS):
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
