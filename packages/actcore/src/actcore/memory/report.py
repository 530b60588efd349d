"""What a :func:`actcore.memory.track` block reports: :class:`MemoryReport`, and byte counts
written for people (:func:`format_bytes`)."""

from __future__ import annotations

import dataclasses

__all__ = ["OUTSIDE", "MemoryReport", "format_bytes"]

OUTSIDE = "<outside>"
"""``by_module`` key for bytes saved inside the block but outside every tracked module."""


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
