"""The saved-tensor hooks route's optimization levels (GACT's table): ``Controller(level=...)``.

A level name of this route is resolved here only (:func:`hook_level`), never against the
layer route's table (:mod:`actcore.config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import lookup_level

__all__ = ["HOOK_LEVELS", "HookLevel", "hook_level"]


@dataclass(frozen=True)
class HookLevel:
    """One optimization level of the saved-tensor hooks route (``Controller(level=...)``)."""

    name: str
    bits: int | None  # fixed bits, or the average-bits budget when ``auto``; None: no compression
    auto: bool = False  # per-tensor bits from sensitivity
    swap: bool = False  # packed tensors moved to pinned CPU memory (GPU only)
    summary: str = ""


HOOK_LEVELS: dict[str, HookLevel] = {
    lv.name: lv
    for lv in (
        HookLevel("L0", None, summary="no compression (gradients bitwise equal to no hooks)"),
        HookLevel("L1", 4, summary="every saved activation at 4 bits"),
        HookLevel("L1.1", 8, summary="every saved activation at 8 bits"),
        HookLevel("L1.2", 2, summary="every saved activation at 2 bits"),
        HookLevel("L2", 4, auto=True, summary="auto precision: 4 bits on average"),
        HookLevel("L2.1", 3, auto=True, summary="auto precision: 3 bits on average"),
        HookLevel("L2.2", 2, auto=True, summary="auto precision: 2 bits on average"),
        HookLevel(
            "L3",
            4,
            auto=True,
            swap=True,
            summary="auto precision, 4 bits on average, packed data swapped to pinned CPU memory",
        ),
    )
}


def hook_level(level: str | HookLevel) -> HookLevel:
    """The :class:`HookLevel` named ``level``, or ValueError listing the valid names."""
    return lookup_level(HOOK_LEVELS, level, HookLevel, "level")
