"""``actcore demo`` (= ``actcore bench``): what ACT saves and what it keeps, in minutes on a CPU.

1. Memory: a torchvision ResNet-50 (random weights) at batch 4, 224x224, one training step
   per level; the bytes autograd holds for backward, against plain PyTorch (``fp``).
2. Accuracy: the digits CNN trained without ACT (``fp``) and at L3, one seed.
3. A short summary. ``--json FILE`` keeps both tables.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from . import accuracy, memory, report
from .models import check_model, torchvision_models
from .routes import FP, check_levels

__all__ = ["DEFAULT_MODEL", "FALLBACK_MODEL", "add_arguments", "configs", "main", "summary"]

DEFAULT_MODEL = "resnet50"
FALLBACK_MODEL = "tiny-cnn"  # when torchvision is missing


def add_arguments(p: argparse.ArgumentParser, common: Callable[[argparse.ArgumentParser], None]):
    """The demo's options (shared by ``actcore demo`` and ``actcore bench``)."""
    from .memory import positive_int

    p.add_argument("--model", default=None, help=f"memory part's model (default {DEFAULT_MODEL})")
    p.add_argument("--batch", type=positive_int, default=4, help="memory part's batch (default 4)")
    p.add_argument("--image-size", type=positive_int, default=None, help="default: the model's")
    p.add_argument("--levels", default="L0,L1,L2,L3", help="memory part's levels")
    p.add_argument("--accuracy-levels", default="fp,L3", help="accuracy part's levels")
    p.add_argument("--epochs", type=positive_int, default=accuracy.AccuracyConfig.epochs)
    p.add_argument("--seeds", type=positive_int, default=1)
    common(p)
    # one thread: fast enough here (small batch, tiny CNN), and robust on a shared machine,
    # where two threads waiting on each other can make each op many times slower
    p.set_defaults(func=main, validate=_validate, threads=1)


def _validate(args: argparse.Namespace) -> None:
    from .memory import split_items

    if args.model is None:
        args.model = DEFAULT_MODEL if torchvision_models() else FALLBACK_MODEL
    check_model(args.model)
    args.levels = check_levels(split_items(args.levels))
    args.accuracy_levels = check_levels(split_items(args.accuracy_levels))


def configs(args: argparse.Namespace) -> tuple[memory.MemoryConfig, accuracy.AccuracyConfig]:
    mem = memory.MemoryConfig(
        model=args.model,
        batch=args.batch,
        levels=args.levels,
        image_size=args.image_size,
        steps=1,
    )
    acc = accuracy.AccuracyConfig(levels=args.accuracy_levels, seeds=args.seeds, epochs=args.epochs)
    return mem, acc


def summary(mem_rows: list[dict[str, Any]], acc_rows: list[dict[str, Any]]) -> list[str]:
    """A few plain sentences about the most compressed level measured."""
    lines = []
    fp = next((r for r in mem_rows if r["level"] == FP and "retained_bytes" in r), None)
    best = [r for r in mem_rows if r["level"] != FP and r.get("ratio")]
    if fp and best:
        top = max(best, key=lambda r: r["ratio"])
        lines.append(
            f"Memory: at {top['level']}, {top['model']} holds "
            f"{report.fmt_bytes(top['retained_bytes'])} for backward instead of "
            f"{report.fmt_bytes(fp['retained_bytes'])}: {top['ratio']:.1f}x less "
            f"({100 * top['saved_fraction']:.1f}% saved); step time "
            f"{top['step_time_s']:.2f} s vs {fp['step_time_s']:.2f} s on {fp['device']}."
        )
    acc_fp = next((r for r in acc_rows if r["level"] == FP), None)
    for row in acc_rows:
        if row["level"] != FP and acc_fp is not None:
            lines.append(
                f"Accuracy: digits test accuracy {100 * row['accuracy_mean']:.2f}% at "
                f"{row['level']} vs {100 * acc_fp['accuracy_mean']:.2f}% without ACT "
                f"({row['delta_points']:+.2f} points, {len(row['accuracies'])} seed(s))."
            )
    if not lines:
        lines.append("Nothing was measured.")
    return lines


def main(args: argparse.Namespace) -> int:
    mem_cfg, acc_cfg = configs(args)
    t0 = time.perf_counter()

    def run(rows: list[dict[str, Any]], advance: Callable[..., None]) -> None:
        memory.run(mem_cfg, rows, advance)
        accuracy.run(acc_cfg, rows, advance)

    def show(rows: list[dict[str, Any]]) -> None:
        mem_rows = [r for r in rows if r["benchmark"] == "memory"]
        acc_rows = [r for r in rows if r["benchmark"] == "accuracy"]
        out = report.console()
        if mem_rows:
            out.print(
                report.table(
                    memory.title(mem_cfg),
                    memory.columns(False, any("error" in r for r in mem_rows)),
                    mem_rows,
                )
            )
        if acc_rows:
            out.print(report.table(accuracy.title(acc_cfg), accuracy.COLUMNS, acc_rows))
        out.print()
        for line in summary(mem_rows, acc_rows):
            out.print(line)
        out.print(f"(demo took {time.perf_counter() - t0:.0f} s; more: actcore bench --help)")

    return report.run_with_progress(
        "demo",
        args,
        len(mem_cfg.resolved_levels()) + len(acc_cfg.levels) * acc_cfg.seeds,
        run,
        config={"memory": asdict(mem_cfg), "accuracy": asdict(acc_cfg)},
        show=show,
    )
