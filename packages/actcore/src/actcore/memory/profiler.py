"""An independent measure of what a call leaves allocated, by ``torch.profiler``; it never
looks at saved tensors, so it cross-checks :func:`actcore.memory.track`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

__all__ = ["profiled_bytes", "profiled_peak_bytes"]


def profiled_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the bytes it left allocated, counted by the profiler.

    An independent measure (it never looks at saved tensors): the sum of the self memory
    over the events of ``torch.profiler.profile(profile_memory=True)``, i.e. allocations
    minus frees during the call, on the CPU (``self_cpu_memory_usage``), or on CUDA
    (``self_device_memory_usage``) when any argument is a CUDA tensor. Around a forward it
    is what the forward saved for backward plus its output, minus saved tensors that were
    allocated before the call (such as the input).
    """
    out, prof, cuda = _profiled(fn, args, kwargs)
    field_name = "self_device_memory_usage" if cuda else "self_cpu_memory_usage"
    return out, sum(getattr(e, field_name, 0) or 0 for e in prof.events())


def profiled_peak_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the most bytes allocated at once during the call beyond
    what was allocated before it, by the profiler: the running sum of its allocation and
    free records in time order (on the device of a CUDA argument, else the CPU). What a
    call's temporaries cost at their peak."""
    out, prof, cuda = _profiled(fn, args, kwargs)
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and (e.device_type().name == "CUDA") == cuda
    )
    now = peak = 0
    for _, nbytes in records:
        now += nbytes
        peak = max(peak, now)
    return out, peak


def _profiled(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any, bool]:
    """``fn``'s output, the profile of its call, and whether it ran on CUDA (an argument
    is a CUDA tensor: its memory is then the device's)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    cuda = any(isinstance(a, Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    gc.collect()
    with profile(activities=activities, profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    return out, prof, cuda
