"""What ``actcore bench train`` trains: the ``--levels`` items (:class:`Variant`, each
applied to a model by :func:`applied_variant`) and the run's settings (:class:`TrainConfig`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .routes import FP, applied, check_levels
from .tasks import SPECS

__all__ = [
    "BUDGET",
    "DEFAULT",
    "DEFAULT_LEVELS",
    "TrainConfig",
    "Variant",
    "applied_variant",
    "parse_levels",
    "resolve_device",
    "valid_items",
]

DEFAULT = "default"
BUDGET = "budget"
DEFAULT_LEVELS = "fp,L2,L3,hooks:G1.2,hooks:G2,default"


@dataclass(frozen=True)
class Variant:
    """One item of ``--levels``: its label, route (``none``, ``layers``, ``hooks``) and level."""

    label: str
    route: str  # none, layers, hooks or budget
    level: str | None  # None for fp and default; the share ("10%") for a budget


def parse_levels(text: str | list[str]) -> list[Variant]:
    """``fp,L2,L3,hooks:G1.2,budget:10%,default`` -> variants (fp first when given, each
    once). ``budget:10%`` plans the model with :func:`actcore.fit_budget` to keep 10% of
    what it keeps exact, on the task's fixed batch.

    ValueError names a bad item and lists what is valid.
    """
    items = text if isinstance(text, list) else [t.strip() for t in text.split(",")]
    items = [t for t in dict.fromkeys(items) if t]
    if not items:
        raise ValueError("no levels given")
    variants = []
    for item in items:
        if item in (FP, DEFAULT):
            variants.append(Variant(item, "none" if item == FP else "layers", None))
            continue
        route, sep, level = item.rpartition(":")
        route = route if sep else "layers"
        if route == BUDGET:
            from ..budget import budget_share

            if budget_share(level) is None:  # ValueError for a bad percentage
                raise ValueError(f"{item!r}: a budget item is budget:SHARE%, e.g. budget:10%")
            variants.append(Variant(item, route, level))
            continue
        if route not in ("layers", "hooks"):
            raise ValueError(
                f"unknown route {route!r} in {item!r}; write LEVEL or layers:LEVEL for "
                "actcore.convert, hooks:LEVEL for actcore.Controller, budget:SHARE% for "
                "actcore.fit_budget, fp or default"
            )
        try:
            check_levels([level], route)
        except ValueError:
            raise ValueError(
                f"unknown level {level!r} in --levels item {item!r}; valid: {valid_items()}"
            ) from None
        label = level if route == "layers" else item
        variants.append(Variant(label, route, level))
    variants = list({v.label: v for v in variants}.values())  # L3 and layers:L3 once
    return sorted(variants, key=lambda v: v.label != FP)


def valid_items() -> str:
    """What ``--levels`` takes, for error messages."""
    from ..config import LEVELS

    try:
        from ..policies import HOOK_LEVELS

        hooks = ", ".join(f"hooks:{lv}" for lv in HOOK_LEVELS)
    except ImportError:
        hooks = "hooks:LEVEL"
    return f"{FP}, {DEFAULT}, {', '.join(LEVELS)}, {hooks}, {BUDGET}:SHARE% (e.g. budget:10%)"


@dataclass
class TrainConfig:
    """What ``bench train`` trains (None: the task's default, or its ``--quick`` one)."""

    task: str = "shakespeare-char"
    arch: str = "gpt"
    levels: list[str] = field(default_factory=lambda: DEFAULT_LEVELS.split(","))
    seeds: int = 1
    steps: int | None = None
    eval_interval: int | None = None
    eval_batches: int | None = None
    batch: int | None = None
    lr: float | None = None
    quick: bool = False
    device: str = "auto"
    data_dir: str | None = None
    compile: bool = False  # torch.compile the model, every level (after its conversion)

    def resolved(self) -> TrainConfig:
        """A copy with every None filled in from the task's defaults."""
        spec = SPECS[self.task]
        q = self.quick
        fill = {
            "steps": spec.quick_steps if q else spec.steps,
            "eval_interval": spec.quick_eval_interval if q else spec.eval_interval,
            "eval_batches": spec.quick_eval_batches if q else spec.eval_batches,
            "batch": spec.batch,
            "lr": spec.lr,
        }
        values = asdict(self)
        for key, default in fill.items():
            if values[key] is None:
                values[key] = default
        return TrainConfig(**values)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def applied_variant(
    model: nn.Module, v: Variant, example: Callable[[nn.Module], Any] | None = None
) -> Iterator[tuple[Callable | None, str]]:
    """Apply ``v`` to ``model``; yields ``(iterate or None, the actcore level in effect)``.

    ``example``: a forward of the task's fixed batch to its loss, which a budget variant
    plans on (:func:`actcore.fit_budget`); its level is the plan's summary."""
    if v.route == BUDGET:
        if example is None:
            raise ValueError(f"{v.label!r} needs an example forward to plan on")
        import actcore

        plan = actcore.fit_budget(model, example, v.level)
        yield None, f"{v.label}: {plan}"
        return
    if v.label == DEFAULT:
        import actcore

        from ..config import config

        actcore.convert(model)
        level = getattr(getattr(model, "act_report", None), "level", None) or config.level
        yield None, str(level)
        return
    with applied(model, v.level or FP, v.route if v.level else "layers") as after:
        yield after, v.level or FP
