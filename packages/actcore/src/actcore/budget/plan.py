"""What a memory plan chose, and the sizes it is given in."""

from __future__ import annotations

import gc
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..config import level_spec
from ..layers.base import QLayer
from ..layers.scope import scope_exact, set_scope_exact
from ..memory import format_bytes
from .checkpointing import is_recomputed, set_recompute

__all__ = [
    "BOUNDS",
    "ORDERS",
    "OUT_OF_MEMORY",
    "MemoryPlan",
    "budget_share",
    "parse_bytes",
    "unless_out_of_memory",
]

OUT_OF_MEMORY = sys.maxsize
"""The bytes a configuration counts as keeping when its forward runs out of device memory:
more than any budget."""

T = TypeVar("T")


def unless_out_of_memory(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when it runs out of CUDA memory, its tensors then freed (once the
    exception's frames are gone) and the allocator's cache emptied."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        pass
    gc.collect()
    torch.cuda.empty_cache()
    return None


ORDERS = ("error", "bytes", "time")
"""How a memory plan chooses: Q-layers coarser first where they save the most bytes per
gradient error, or the most bytes; or (``"time"``) the levels and recomputed blocks of
least step time and gradient error together, by a knapsack over measured costs."""
BOUNDS = ("kept", "peak")
"""What a memory budget bounds: the bytes a forward keeps for backward, or the peak of a
whole training step above its start."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def budget_share(size: object) -> float | None:
    """The share of the exact bytes a budget such as ``"10%"`` asks for (0.1), or None when
    ``size`` is not a percentage (then it is a size in bytes, :func:`parse_bytes`)."""
    if not isinstance(size, str) or not size.strip().endswith("%"):
        return None
    number = size.strip()[:-1].strip()
    try:
        share = float(number) / 100
    except ValueError:
        share = math.nan
    if not math.isfinite(share) or share <= 0:
        raise ValueError(
            f"cannot read {size!r} as a share of the exact bytes: use a positive number "
            "and '%' (e.g. '10%')"
        )
    return share


def parse_bytes(size: int | float | str) -> int:
    """``size`` in bytes: an int, or a string such as ``"6GiB"``, ``"512 MiB"``, ``"1.5GB"``."""
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise TypeError(f"a memory size is an int of bytes or a string like '6GiB', got {size!r}")
    if isinstance(size, str) and size.strip().endswith("%"):
        raise ValueError(
            f"{size!r} is a share of the exact bytes, which only fit_budget takes; give a "
            "size in bytes here (e.g. '6GiB')"
        )
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {size!r} as a memory size: use a number and one of "
                "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '6GiB')"
            )
        size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"a memory budget must be a positive number of bytes, got {size!r}")
    return int(size)


@dataclass(frozen=True)
class MemoryPlan:
    """The level of each Q-layer and the blocks to recompute that :func:`fit_budget` chose,
    and what it measured."""

    budget: int  # bytes asked for
    levels: Mapping[str, str]  # Q-layer name -> level name
    kept_bytes: int  # what a forward of the example inputs keeps under this plan
    exact_bytes: int  # ... with every Q-layer at the finest candidate level
    smallest_bytes: int  # ... the least any plan of these candidates keeps
    recompute: Sequence[str] = field(default=())  # blocks recomputed in backward
    bound: str = "kept"  # what the budget bounds: "kept" bytes or a step's "peak"
    peak_bytes: int | None = None  # the step's measured peak (bound "peak")
    # Q-layer name -> level name -> what it keeps with every Q-layer at that level
    layer_bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    order: str = "bytes"  # which layers went coarser first: "error" or "bytes"
    # Q-layer name -> level name -> its share of the squared gradient error, relative to
    # the exact gradient's squared norm (order "error")
    layer_error: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    gradient_error: float | None = None  # the plan's predicted relative squared error
    predicted_bytes: int | None = None  # what the knapsack predicted it keeps (order "time")
    step_seconds: float | None = None  # the plan's predicted step time (order "time")
    exact_seconds: float | None = None  # the measured step with every Q-layer exact
    # module -> whether the model scope compresses what it saves there (True) or keeps it
    # exact (order "time" on a model with a scope; "" is what no other unit holds)
    scope: Mapping[str, bool] = field(default_factory=dict)

    def apply(self, model: nn.Module) -> nn.Module:
        """Set each planned Q-layer of ``model`` to its level, recompute exactly the plan's
        blocks (any other recomputed module is switched back), and keep the plan on the
        model for :mod:`actcore.resume`; returns ``model``."""
        self.check(model)
        for name, level in self.levels.items():
            model.get_submodule(name).act_level = level
        chosen = set(self.recompute)
        for name, module in model.named_modules():
            if name in chosen or is_recomputed(module):
                set_recompute(module, name in chosen)
            if name in self.scope:
                set_scope_exact(module, not self.scope[name])
            elif scope_exact(module) is not None:
                set_scope_exact(module, None)
        model.__dict__["act_memory_plan"] = self
        return model

    def check(self, model: nn.Module) -> None:
        """ValueError unless every planned name is a Q-layer of ``model`` and every level is
        one of :data:`actcore.config.LEVELS`."""
        for name, level in self.levels.items():
            level_spec(level)  # ValueError naming an unknown level
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                layer = None
            if not isinstance(layer, QLayer):
                raise ValueError(
                    f"the memory plan sets {name!r} to {level}, but {type(model).__name__} has "
                    "no Q-layer of that name: load it into the model it was made for, "
                    "converted the same way"
                )
        names = {name for name, _ in model.named_modules()}
        for name in self.recompute:
            if name not in names:
                raise ValueError(
                    f"the memory plan recomputes {name!r}, but {type(model).__name__} has no "
                    "module of that name: load it into the model it was made for"
                )
        for name in self.scope:
            if name not in names:
                raise ValueError(
                    f"the memory plan sets the scope in {name!r}, but {type(model).__name__} "
                    "has no module of that name: load it into the model it was made for"
                )
        if any(self.scope.values()) and getattr(model, "act_scope", None) is None:
            raise ValueError(
                f"the memory plan compresses the rest of the forward in "
                f"{[n for n, on in self.scope.items() if on]}, but this "
                f"{type(model).__name__} has no model scope: convert it at a level that "
                "compresses, as the model it was made for was"
            )

    def state_dict(self) -> dict[str, Any]:
        """The plan as plain data (:func:`actcore.resume.state_dict` saves it)."""
        return {
            "budget": self.budget,
            "levels": dict(self.levels),
            "kept_bytes": self.kept_bytes,
            "exact_bytes": self.exact_bytes,
            "smallest_bytes": self.smallest_bytes,
            "recompute": list(self.recompute),
            "bound": self.bound,
            "peak_bytes": self.peak_bytes,
            "layer_bytes": {n: dict(b) for n, b in self.layer_bytes.items()},
            "order": self.order,
            "layer_error": {n: dict(e) for n, e in self.layer_error.items()},
            "gradient_error": self.gradient_error,
            "predicted_bytes": self.predicted_bytes,
            "step_seconds": self.step_seconds,
            "exact_seconds": self.exact_seconds,
            "scope": dict(self.scope),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> MemoryPlan:
        """The plan :meth:`state_dict` saved (KeyError naming a missing field)."""
        fields = ("budget", "levels", "kept_bytes", "exact_bytes", "smallest_bytes")
        missing = [f for f in fields if f not in state]
        if missing:
            raise KeyError(f"a saved memory plan lacks {missing}; it has {sorted(state)}")
        return cls(
            **{f: state[f] for f in fields},
            recompute=tuple(state.get("recompute", ())),
            bound=state.get("bound", "kept"),
            peak_bytes=state.get("peak_bytes"),
            layer_bytes={n: dict(b) for n, b in state.get("layer_bytes", {}).items()},
            order=state.get("order", "bytes"),
            layer_error={n: dict(e) for n, e in state.get("layer_error", {}).items()},
            gradient_error=state.get("gradient_error"),
            predicted_bytes=state.get("predicted_bytes"),
            step_seconds=state.get("step_seconds"),
            exact_seconds=state.get("exact_seconds"),
            scope=dict(state.get("scope", {})),
        )

    def describe(self) -> str:
        """How many Q-layers are at each level, and the blocks recomputed."""
        counts: dict[str, int] = {}
        for level in self.levels.values():
            counts[level] = counts.get(level, 0) + 1
        spread = ", ".join(f"{n} at {level}" for level, n in sorted(counts.items()))
        if self.recompute:
            spread += f"; {len(self.recompute)} blocks recomputed ({', '.join(self.recompute)})"
            packed = [b for b in self.recompute if self.scope.get(b)]
            if packed:
                spread += f", {len(packed)} of them with the input packed"
        if self.scope:
            on = [n or "the rest" for n, c in self.scope.items() if c]
            spread += f"; the scope compressing in {len(on)} of {len(self.scope)} parts" + (
                f" ({', '.join(on)})" if on else ""
            )
        return spread

    def table(self) -> str:
        """The plan, one line per Q-layer: its level, what it keeps there and exact (each
        measured with every Q-layer at that level), the bytes that saves, its share of the
        squared gradient error relative to the gradient's (order ``"error"``), and why it
        is where it is. Layers go coarser in the order of the bytes they save per gradient
        error (or of the bytes alone) until the budget fits; those inside a recomputed
        block stay exact. With order ``"time"`` on a model with a scope, one more line per
        block (and one for the rest of the model) says whether the scope compresses there."""
        finest = next(iter(next(iter(self.layer_bytes.values()), {})), None)
        lines = [str(self), ""]
        header = ("Q-layer", "level", "kept", "exact", "saved", "error", "why")
        rows = []
        for name, level in self.levels.items():
            by_level = self.layer_bytes.get(name, {})
            kept, exact = by_level.get(level), by_level.get(finest)
            block = next((b for b in self.recompute if name == b or name.startswith(b + ".")), None)
            if block is not None:
                why = f"recomputed with {block}"
            elif len(set(by_level.values())) == 1:
                why = "no level keeps less"
            elif level == finest:
                why = "the budget leaves it exact"
            elif self.order == "time":
                why = "coarser: its bytes saved cost less step time and error than others'"
            elif self.order == "error":
                why = "coarser: more bytes saved per gradient error than those left finer"
            else:
                why = "coarser: saves more than the layers left finer"
            saved = "-" if kept is None or exact is None else format_bytes(exact - kept)
            error = self.layer_error.get(name, {}).get(level)
            rows.append(
                (
                    name,
                    level,
                    "-" if kept is None else format_bytes(kept),
                    "-" if exact is None else format_bytes(exact),
                    saved,
                    "-" if error is None else f"{error:.2e}",
                    why,
                )
            )
        for unit, on in self.scope.items():
            recomputed = unit in self.recompute
            why = (
                "recomputed, its input packed: fewer bytes than recompute alone, for less "
                "step time and error than other ways to fit"
                if recomputed and on
                else "recomputed, its input exact"
                if recomputed
                else "its compression costs less step time and error than other ways to fit"
                if on
                else "the budget fits with it exact, or recompute costs less"
            )
            rows.append((unit or "(the rest)", "scope " + ("on" if on else "exact"), *"----", why))
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        peak = (
            f", a step peaking at {format_bytes(self.peak_bytes)}"
            if self.peak_bytes is not None
            else ""
        )
        exact = (
            "runs out of device memory"
            if self.exact_bytes == OUT_OF_MEMORY
            else format_bytes(self.exact_bytes)
        )
        error = (
            f", gradient error {self.gradient_error:.2e} (predicted, relative squared)"
            if self.gradient_error is not None
            else ""
        )
        if self.step_seconds is not None and self.exact_seconds:
            error += f", a step {self.step_seconds / self.exact_seconds:.2f}x exact's (predicted)"
        return (
            f"MemoryPlan: keeps {format_bytes(self.kept_bytes)}{peak}{error} for a budget of "
            f"{format_bytes(self.budget)} on the {self.bound} bytes (exact {exact}, "
            f"smallest reachable {format_bytes(self.smallest_bytes)}); {self.describe()}"
        )
