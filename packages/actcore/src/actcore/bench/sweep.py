"""``actcore bench sweep``: training throughput against batch size, per level, as a PNG.

For each level and batch a fresh model runs the ``bench memory`` measurement (bytes held
for backward, then timed steps). On CUDA a batch that raises ``torch.OutOfMemoryError`` is
marked out of memory, and so are the larger ones of that level; the plot draws a red cross
where a level (fp first of all) runs out of memory. On a CPU use small batches.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import report
from .memory import MemoryConfig, measure_level, positive_int, resolve_device, split_items
from .models import check_model, default_image_size
from .routes import chosen_levels

__all__ = ["COLUMNS", "SweepConfig", "figure", "main", "plot", "register", "run"]


@dataclass
class SweepConfig:
    """What ``bench sweep`` measures."""

    model: str = "resnet18"
    levels: list[str] = field(default_factory=lambda: ["fp", "L2", "L3"])
    batches: list[int] = field(default_factory=lambda: [2, 4, 8])
    route: str = "layers"
    amp: str = "none"
    image_size: int | None = None
    steps: int = 2
    device: str = "auto"


def run(
    cfg: SweepConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Append one row per (level, batch) to ``rows``."""
    device = resolve_device(cfg.device)
    for level in cfg.levels:
        out_of_memory = False
        for batch in cfg.batches:
            base = {"benchmark": "sweep", "model": cfg.model, "level": level, "batch": batch}
            if out_of_memory:  # a smaller batch already ran out: do not try a larger one
                rows.append({**base, "oom": True, "tried": False})
                advance(1)
                continue
            advance(0, description=f"{cfg.model} {level} batch {batch}")
            mem = MemoryConfig(
                model=cfg.model,
                batch=batch,
                levels=[level],
                route=cfg.route,
                amp=cfg.amp,
                image_size=cfg.image_size,
                steps=cfg.steps,
                device=str(device),
            )
            try:
                row = {**measure_level(mem, level, device), **base, "oom": False}
            except torch.OutOfMemoryError:
                row = {**base, "oom": True, "tried": True}
            if row["oom"]:
                out_of_memory = True
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            advance(1)


def figure(cfg: SweepConfig, rows: list[dict[str, Any]]) -> Any:
    """A matplotlib Figure: throughput against batch per level, red crosses at out of memory."""
    Figure = report.optional_import("matplotlib.figure").Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    ax = fig.subplots()
    crossed = False
    for level in dict.fromkeys(r["level"] for r in rows):
        ok = [r for r in rows if r["level"] == level and not r["oom"]]
        xs = [r["batch"] for r in ok]
        ys = [r["throughput"] for r in ok]
        ax.plot(xs, ys, marker="o", label=level)
        first_oom = next((r for r in rows if r["level"] == level and r["oom"]), None)
        if first_oom is not None:
            y = ys[-1] if ys else 0.0
            ax.plot(
                [first_oom["batch"]],
                [y],
                marker="x",
                color="red",
                markersize=12,
                markeredgewidth=3,
                linestyle="none",
                label=None if crossed else "out of memory",
            )
            crossed = True
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches, labels=[str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("training throughput (samples/s)")
    size = cfg.image_size or default_image_size(cfg.model)
    device = resolve_device(cfg.device)
    ax.set_title(f"{cfg.model} {size}x{size}, route {cfg.route} on {device}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(cfg: SweepConfig, rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Save :func:`figure` as a PNG at ``path``."""
    path = Path(path)
    fig = figure(cfg, rows)
    with report.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


COLUMNS = [
    report.Column("level", "level", justify="left"),
    report.Column("batch", "batch"),
    report.Column("retained_bytes", "held for backward", report.fmt_bytes),
    report.Column("step_time_s", "step s", report.fmt_float(3)),
    report.Column("throughput", "samples/s", report.fmt_float(1)),
    report.Column("oom", "out of memory", lambda v: "yes" if v else "no"),
]


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench sweep``."""
    p = subparsers.add_parser(
        "sweep",
        help="throughput against batch size per level, plotted to a PNG",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=SweepConfig.model)
    p.add_argument(
        "--levels", default=None, help="comma-separated (default fp,L2,L3; fp,G2,G3 for hooks)"
    )
    p.add_argument("--batches", default="2,4,8", help="comma-separated batch sizes")
    p.add_argument("--route", choices=["layers", "hooks"], default="layers")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    p.add_argument("--image-size", type=positive_int, default=None)
    p.add_argument("--steps", type=positive_int, default=2, help="timed steps per point")
    p.add_argument("--device", default="auto")
    p.add_argument("--png", default="actcore-sweep.png", help="where the plot goes")
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _batches(text: str) -> list[int]:
    try:
        values = [int(part) for part in split_items(text)]
    except ValueError:
        raise ValueError(f"--batches takes positive integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--batches takes positive integers, got {text!r}")
    return sorted(set(values))


def _validate(args: argparse.Namespace) -> None:
    check_model(args.model)
    given = None if args.levels is None else split_items(args.levels)
    args.levels = chosen_levels(given, "fp,L2,L3", args.route)
    args.batches = _batches(args.batches) if isinstance(args.batches, str) else args.batches
    resolve_device(args.device)


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(SweepConfig, args)
    size = cfg.image_size or default_image_size(cfg.model)
    title = f"{cfg.model} {size}x{size}, route {cfg.route}: throughput by batch size"

    def show(rows: list[dict[str, Any]]) -> None:
        report.console().print(report.table(title, COLUMNS, rows))
        if rows:
            path = plot(cfg, rows, args.png)
            report.console(stderr=True).print(f"wrote {path}")

    return report.run_with_progress(
        "sweep",
        args,
        len(cfg.levels) * len(cfg.batches),
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg) | {"png": args.png},
        show=show,
    )
