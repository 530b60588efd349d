"""An independent measure of what a call leaves allocated, by ``torch.profiler``; it never
looks at saved tensors, so it cross-checks :func:`actcore.memory.track`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

__all__ = ["profiled_bytes"]


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
