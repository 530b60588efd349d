"""``actcore bench plan``: memory plans across budgets, each with what it keeps, its step
time and its gradient against the exact model's.

Budgets run from what every Q-layer at L0 keeps down to what every one at L3 keeps, then
``--below`` more in 10% steps under that, where the plan recomputes blocks, until none
fits. For each, :func:`actcore.fit_budget` plans the model; the row gives what the plan
keeps (ACT's tracker), its levels and recomputed blocks, the median time of a training
step (forward and backward, no optimizer; after one warm-up step) against the unconverted
model's, timed alternately with it, and the cosine of all parameter gradients against the
unconverted model's on the same batch and random draws (seeded ``seed + 1``, which the
planner's probe steps never use), and the planner's predicted relative squared gradient
error. ``--order``: the planner's order (most bytes per gradient error, or most bytes).
CPU or CUDA. No time model orders the plans yet.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import budget as act_budget
from . import report
from .memory import positive_int, resolve_device, sync_device
from .models import build_model, check_model, logits
from .zoo import grad_cosine

__all__ = ["COLUMNS", "PlanConfig", "main", "register", "run"]


@dataclass
class PlanConfig:
    """What ``bench plan`` measures."""

    model: str = "resnet18"
    batch: int = 4
    image_size: int | None = 64
    budgets: int = 6
    below: int = 2
    steps: int = 3
    device: str = "cpu"
    seed: int = 0
    order: str = "error"


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> list[Any]:
    """Every parameter's gradient after one seeded step (None where it has none)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    F.cross_entropy(logits(model(x)).float(), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    sync_device(x.device)
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(logits(model(x)).float(), y).backward()
    sync_device(x.device)
    return time.perf_counter() - t0


def _paired_seconds(
    model: nn.Module, plain: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int
) -> tuple[float, float]:
    """Median step seconds of ``model`` and of ``plain``, timed alternately (after one
    warm-up step each), so that a machine's load weighs on both alike."""
    _step(model, x, y)
    _step(plain, x, y)
    mine, theirs = [], []
    for _ in range(steps):
        mine.append(_step(model, x, y))
        theirs.append(_step(plain, x, y))
    return statistics.median(mine), statistics.median(theirs)


def run(
    cfg: PlanConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Append one row per budget (the last, a budget no plan fits, says so)."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, image_size=cfg.image_size)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, *built.input_shape, generator=g).to(device)
    y = torch.randint(0, built.num_classes, (cfg.batch,), generator=g).to(device)
    plain = copy.deepcopy(built.model).to(device)
    draw = cfg.seed + 1  # the gradients' random draws: not the planner's probes' (seed 0)
    reference = _grads(plain, x, y, draw)
    model = built.model.to(device)

    def loss(m: nn.Module) -> torch.Tensor:  # what the planner's probe steps back up from
        return F.cross_entropy(logits(m(x)).float(), y)

    top = act_budget.fit_budget(model, loss, 2**62, recompute=False, order="bytes")
    span = top.exact_bytes - top.smallest_bytes
    budgets = [
        int(top.smallest_bytes + span * (1 - i / max(1, cfg.budgets - 1)))
        for i in range(cfg.budgets)
    ]
    budgets += [int(top.smallest_bytes * (1 - 0.1 * k)) for k in range(1, cfg.below + 1)]
    for budget in budgets:
        row: dict[str, Any] = {"model": cfg.model, "batch": cfg.batch, "budget": budget}
        try:
            plan = act_budget.fit_budget(model, loss, budget, order=cfg.order)
        except ValueError as e:
            rows.append({**row, "error": str(e)})
            advance(1)
            break
        counts: dict[str, int] = {}
        for level in plan.levels.values():
            counts[level] = counts.get(level, 0) + 1
        grads = _grads(model, x, y, draw)
        seconds, plain_seconds = _paired_seconds(model, plain, x, y, cfg.steps)
        rows.append(
            {
                **row,
                "kept_bytes": plan.kept_bytes,
                "used": plan.kept_bytes / budget,
                "levels": ", ".join(f"{n} {lv}" for lv, n in sorted(counts.items())),
                "recomputed": len(plan.recompute),
                "step_ms": seconds * 1e3,
                "vs_plain": seconds / plain_seconds,
                "grad_cosine": grad_cosine(grads, reference),
                "order": plan.order,
                "predicted_error": plan.gradient_error,
            }
        )
        advance(1)


COLUMNS = [
    report.Column("budget", "budget", report.fmt_bytes),
    report.Column("kept_bytes", "kept", report.fmt_bytes),
    report.Column("used", "used", lambda v: "" if v is None else f"{100 * v:.1f}%"),
    report.Column("levels", "Q-layers", justify="left"),
    report.Column("recomputed", "recomputed"),
    report.Column("step_ms", "step ms", report.fmt_float(1)),
    report.Column("vs_plain", "vs plain", report.fmt_float(2, "x")),
    report.Column("grad_cosine", "grad cosine", report.fmt_float(4)),
    report.Column("predicted_error", "pred. error", lambda v: "" if v is None else f"{v:.2e}"),
    report.Column("error", "", lambda v: "no plan fits (the JSON says why)", justify="left"),
]


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench plan``."""
    p = subparsers.add_parser(
        "plan",
        help="memory plans across budgets: bytes kept, step time, gradient cosine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--image-size", type=positive_int, default=64)
    p.add_argument("--budgets", type=positive_int, default=6, help="from exact to all-L3")
    p.add_argument("--below", type=int, default=2, help="budgets under all-L3 (10%% steps)")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per plan")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--order",
        choices=act_budget.ORDERS,
        default="error",
        help="which layers go coarser first: most bytes per gradient error, or most bytes",
    )
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _validate(args: argparse.Namespace) -> None:
    check_model(args.model)
    if args.below < 0:
        raise ValueError(f"--below takes a count >= 0, got {args.below}")


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(PlanConfig, args)
    title = f"memory plans: {cfg.model}, batch {cfg.batch}, {cfg.device}"
    return report.run_with_progress(
        "plan",
        args,
        cfg.budgets + cfg.below,
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg),
        show=lambda rows: report.console().print(report.table(title, COLUMNS, rows)),
    )
