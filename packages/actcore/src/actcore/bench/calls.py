"""Counting what one training step calls: ATen ops (each a kernel launch on a GPU) and the
ones among them that make the device wait for the host (reading a value back, sizing an
output from the data)."""

from __future__ import annotations

import collections
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["SYNCING", "count_calls"]

SYNCING = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), bool(), int() of a tensor
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique2",
        "aten::masked_scatter",
    }
)
"""ATen ops that synchronise a CUDA device with the host. ``repeat_interleave`` is not named:
with a tensor of repeats and no ``output_size`` it reads its size back through
``_local_scalar_dense`` (counted), and with an int (grouped-query attention's keys) or an
``output_size`` it reads nothing."""


def count_calls(step: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Run ``step`` once under the profiler: its number of ATen calls (nested calls
    included) and the :data:`SYNCING` ones by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events()]
    aten = sum(1 for n in names if n.startswith("aten::"))
    syncing = collections.Counter(n for n in names if n in SYNCING)
    return aten, dict(syncing)
