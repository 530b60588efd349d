"""``actcore bench plan``: memory plans across budgets, each with what it keeps, its step
time and its gradient against the exact model's.

Budgets run from what every Q-layer at L0 keeps down to what every one at L3 keeps (with
``--order time``, down to the least any of its plans keeps), then ``--below`` more in 10%
steps under that, where the plan recomputes blocks, until none fits. For each, :func:`actcore.fit_budget` plans the model; the row gives what the plan
keeps (ACT's tracker), its levels and recomputed blocks, the median time of a training
step (forward and backward, no optimizer; after one warm-up step) against the unconverted
model's, timed alternately with it, and the cosine of all parameter gradients against the
unconverted model's on the same batch and random draws (seeded ``seed + 1``, which the
planner's probe steps never use), and the planner's predicted relative squared gradient
error. ``--order``: the planner's order (most bytes per gradient error, most bytes, or
``time``: the fastest plan by measured costs, the model scope switched per block). Each
row also plans checkpointing alone at the same budget (blocks recomputed, nothing
compressed: ``fit_budget(levels=("L0",))``) and times its step in the same alternation:
what it keeps and the plan's step against it (blank where checkpointing cannot fit).
``--compiled F,...``: PyTorch's own knapsack beside them, the plain model under
``torch.compile`` with ``activation_memory_budget`` at each fraction F (recompute chosen by
the partitioner): what its forward keeps (the profiler's self memory, less the loss; CUDA:
``memory_allocated``), its step (after two compiling steps) against plain, timed in turn,
and its gradient cosine. ``--png``: the frontier, step time and gradient cosine against the
bytes kept, for the plans, for checkpointing alone and for the compiled budgets. CPU or
CUDA.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import budget as act_budget
from ..convert import convert as actcore_convert
from . import report
from .memory import positive_int, resolve_device, sync_device
from .models import build_model, check_model, logits
from .zoo import grad_cosine

__all__ = ["COLUMNS", "PlanConfig", "figure", "main", "plot", "register", "run", "sweep_budgets"]


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
    compiled: tuple[float, ...] = ()


Loss = Callable[[nn.Module], torch.Tensor]


def _grads(model: nn.Module, loss: Loss, seed: int) -> list[Any]:
    """Every parameter's gradient after one seeded step (None where it has none)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss(model).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _step(model: nn.Module, loss: Loss, device: torch.device) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    loss(model).backward()
    sync_device(device)
    return time.perf_counter() - t0


def _alternated_seconds(
    models: list[nn.Module], loss: Loss, device: torch.device, steps: int
) -> list[float]:
    """Median step seconds of each model, timed in turn (after one warm-up step each), so
    that a machine's load weighs on all alike."""
    for model in models:
        _step(model, loss, device)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        for model, seconds in zip(models, times, strict=True):
            seconds.append(_step(model, loss, device))
    return [statistics.median(seconds) for seconds in times]


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
    ckpt = actcore_convert(copy.deepcopy(plain), level="L0")  # checkpointing alone

    def loss(m: nn.Module) -> torch.Tensor:  # what the planner's probe steps back up from
        return F.cross_entropy(logits(m(x)).float(), y)

    sweep_budgets(
        built.model.to(device),
        plain,
        ckpt,
        loss,
        rows,
        budgets=cfg.budgets,
        below=cfg.below,
        steps=cfg.steps,
        order=cfg.order,
        draw=cfg.seed + 1,  # the gradients' random draws: not the planner's probes' (seed 0)
        row={"model": cfg.model, "batch": cfg.batch},
        advance=advance,
    )
    compiled_budgets(
        plain, loss, rows, cfg.compiled, steps=cfg.steps, draw=cfg.seed + 1, advance=advance
    )


def sweep_budgets(
    model: nn.Module,
    plain: nn.Module,
    ckpt: nn.Module,
    loss: Loss,
    rows: list[dict[str, Any]],
    *,
    budgets: int,
    below: int,
    steps: int,
    order: str,
    draw: int,
    row: dict[str, Any],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Plan ``model`` (unconverted, or converted as ``order`` needs) at ``budgets`` budgets
    from exact to the all-L3 bytes (order ``"time"``: to the least any of its plans keeps)
    and ``below`` more under them, each beside checkpointing
    alone (``ckpt``: a copy converted at L0) and timed with ``plain``; one row each in
    ``rows`` (``row``'s fields first), the last a budget no plan fits where one is reached.
    ``loss(model)``: a training step's loss; ``draw``: the seed of the gradients compared."""
    device = _device_of(plain)
    reference = _grads(plain, loss, draw)
    # the exact and the all-L3 bytes (the time order converts at its scope's level first)
    first = "time" if order == "time" else "bytes"
    top = act_budget.fit_budget(model, loss, 2**62, recompute=False, order=first)
    lowest = top.smallest_bytes
    if order == "time":  # its least, recompute and the scope included, is known once planned
        lowest = act_budget.fit_budget(model, loss, lowest, order="time").smallest_bytes
    span = top.exact_bytes - lowest
    targets = [int(lowest + span * (1 - i / max(1, budgets - 1))) for i in range(budgets)]
    targets += [int(lowest * (1 - 0.1 * k)) for k in range(1, below + 1)]
    for budget in targets:
        out: dict[str, Any] = {**row, "budget": budget}
        try:
            plan = act_budget.fit_budget(model, loss, budget, order=order)
        except ValueError as e:
            rows.append({**out, "error": str(e)})
            advance(1)
            break
        try:
            alone = act_budget.fit_budget(ckpt, loss, budget, levels=("L0",), order="bytes")
        except ValueError:
            alone = None
        counts: dict[str, int] = {}
        for level in plan.levels.values():
            counts[level] = counts.get(level, 0) + 1
        grads = _grads(model, loss, draw)
        timed = [model, plain] + ([ckpt] if alone is not None else [])
        seconds = _alternated_seconds(timed, loss, device, steps)
        out |= {
            "kept_bytes": plan.kept_bytes,
            "used": plan.kept_bytes / budget,
            "levels": ", ".join(f"{n} {lv}" for lv, n in sorted(counts.items())),
            "recomputed": len(plan.recompute),
            "scope_on": sum(plan.scope.values()) if plan.scope else None,
            "step_ms": seconds[0] * 1e3,
            "vs_plain": seconds[0] / seconds[1],
            "predicted_vs_exact": (
                plan.step_seconds / plan.exact_seconds
                if plan.step_seconds is not None and plan.exact_seconds
                else None
            ),
            "predicted_bytes": plan.predicted_bytes,
            "grad_cosine": grad_cosine(grads, reference),
            "order": plan.order,
            "predicted_error": plan.gradient_error,
        }
        if alone is not None:
            out |= {
                "ckpt_kept_bytes": alone.kept_bytes,
                "ckpt_recomputed": len(alone.recompute),
                "ckpt_ms": seconds[2] * 1e3,
                "vs_ckpt": seconds[0] / seconds[2],
            }
        rows.append(out)
        advance(1)


def compiled_budgets(
    plain: nn.Module,
    loss: Loss,
    rows: list[dict[str, Any]],
    fractions: tuple[float, ...],
    *,
    steps: int,
    draw: int,
    row: dict[str, Any] | None = None,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """One row in ``rows`` per fraction: a copy of ``plain`` compiled with
    ``activation_memory_budget=fraction`` (``"compiled": fraction``), what its forward keeps
    by the profiler, its step against ``plain``'s (timed in turn), its gradient cosine."""
    from ..memory import profiled_bytes
    from .zoo import compile_settings

    if not fractions:
        return
    device = _device_of(plain)
    reference = _grads(plain, loss, draw)
    for fraction in fractions:
        torch._dynamo.reset()
        model = copy.deepcopy(plain)
        compiled = torch.compile(model)
        with compile_settings("budget", fraction):
            for _ in range(2):  # compiles forward and backward
                _step(compiled, loss, device)
            if device.type == "cuda":
                sync_device(device)
                before = torch.cuda.memory_allocated(device)
                out = loss(compiled)
                sync_device(device)
                kept = torch.cuda.memory_allocated(device) - before
            else:
                out, kept = profiled_bytes(functools.partial(loss, compiled))
            kept -= out.numel() * out.element_size()
            del out
            grads = _grads(compiled, loss, draw)
            seconds = _alternated_seconds([compiled, plain], loss, device, steps)
        rows.append(
            {
                **(row or {}),
                "compiled": fraction,
                "kept_bytes": kept,
                "step_ms": seconds[0] * 1e3,
                "vs_plain": seconds[0] / seconds[1],
                "grad_cosine": grad_cosine(grads, reference),
            }
        )
        advance(1)
    torch._dynamo.reset()


def figure(rows: list[dict[str, Any]], title: str) -> Any:
    """A matplotlib Figure: step time against plain and gradient cosine, each against the
    bytes kept, for the plans, for checkpointing alone at the same budgets and for the
    compiled activation_memory_budget rows."""
    Figure = report.optional_import("matplotlib.figure").Figure
    planned = [r for r in rows if "error" not in r and "compiled" not in r]
    alone = [r for r in planned if "ckpt_ms" in r]
    compiled = [r for r in rows if "compiled" in r]
    order = planned[0]["order"] if planned else "?"
    fig = Figure(figsize=(10, 4.2), dpi=120)
    time_ax, cosine_ax = fig.subplots(1, 2)
    mib = 2**20
    time_ax.plot(
        [r["kept_bytes"] / mib for r in planned],
        [r["vs_plain"] for r in planned],
        marker="o",
        label=f"ACT plan (order {order})",
    )
    time_ax.plot(
        [r["ckpt_kept_bytes"] / mib for r in alone],
        [r["vs_plain"] * r["ckpt_ms"] / r["step_ms"] for r in alone],
        marker="s",
        label="checkpointing alone",
    )

    def compiled_points(ax: Any, key: str) -> None:
        ax.plot(
            [r["kept_bytes"] / mib for r in compiled],
            [r[key] for r in compiled],
            marker="^",
            linestyle="none",
            color="tab:green",
            label="compiled, activation_memory_budget",
        )

    if compiled:
        compiled_points(time_ax, "vs_plain")
        for r in compiled:
            time_ax.annotate(f"{r['compiled']:g}", (r["kept_bytes"] / mib, r["vs_plain"]))
    time_ax.set_xlabel("kept for backward (MiB)")
    time_ax.set_ylabel("step time / plain step")
    cosine_ax.plot(
        [r["kept_bytes"] / mib for r in planned],
        [r["grad_cosine"] for r in planned],
        marker="o",
        label=f"ACT plan (order {order})",
    )
    cosine_ax.axhline(1.0, color="grey", linestyle=":", label="checkpointing alone (exact)")
    if compiled:
        compiled_points(cosine_ax, "grad_cosine")
    cosine_ax.set_xlabel("kept for backward (MiB)")
    cosine_ax.set_ylabel("gradient cosine to plain")
    for ax in (time_ax, cosine_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(rows: list[dict[str, Any]], title: str, path: str | Path) -> Path:
    """Save :func:`figure` as a PNG at ``path``."""
    path = Path(path)
    fig = figure(rows, title)
    with report.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


COLUMNS = [
    report.Column("compiled", "compiled at", lambda v: "" if v is None else f"{v:g}"),
    report.Column("budget", "budget", report.fmt_bytes),
    report.Column("kept_bytes", "kept", report.fmt_bytes),
    report.Column("used", "used", lambda v: "" if v is None else f"{100 * v:.1f}%"),
    report.Column("levels", "Q-layers", justify="left"),
    report.Column("recomputed", "recomputed"),
    report.Column("scope_on", "scope on"),
    report.Column("step_ms", "step ms", report.fmt_float(1)),
    report.Column("vs_plain", "vs plain", report.fmt_float(2, "x")),
    report.Column("predicted_vs_exact", "pred. vs exact", report.fmt_float(2, "x")),
    report.Column("ckpt_kept_bytes", "ckpt kept", report.fmt_bytes),
    report.Column("vs_ckpt", "vs ckpt", report.fmt_float(2, "x")),
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
        help="which layers go coarser first: most bytes per gradient error, or most bytes; "
        "or time: the fastest plan by measured costs",
    )
    p.add_argument(
        "--compiled",
        type=_fractions,
        default=(),
        help="activation_memory_budget fractions to compile the plain model at, e.g. 0.2,0.5",
    )
    p.add_argument("--png", default=None, help="plot the frontier to this PNG")
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = (-1.0,)
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"takes fractions in (0, 1] separated by commas, e.g. 0.2,0.5; got {text!r}"
        )
    return values


def _validate(args: argparse.Namespace) -> None:
    check_model(args.model)
    if args.below < 0:
        raise ValueError(f"--below takes a count >= 0, got {args.below}")


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(PlanConfig, args)
    title = f"memory plans: {cfg.model}, batch {cfg.batch}, {cfg.device}"

    def show(rows: list[dict[str, Any]]) -> None:
        report.console().print(report.table(title, COLUMNS, rows))
        if rows and args.png:
            path = plot(rows, title, args.png)
            report.console(stderr=True).print(f"wrote {path}")

    return report.run_with_progress(
        "plan",
        args,
        cfg.budgets + cfg.below + len(cfg.compiled),
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg) | {"png": args.png},
        show=show,
    )
