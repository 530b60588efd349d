"""The results of ``actcore bench train``: one row per level (means over seeds, differences
to fp), their table and their plot of the training and validation curves."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from . import report
from .routes import FP
from .tasks import SPECS
from .train_config import DEFAULT, TrainConfig, Variant, resolve_device

__all__ = ["add_deltas", "columns", "figure", "make_row", "plot", "show", "title"]


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if len(vals) == len(values) and vals else None


def _std(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    if len(vals) < len(values) or not vals:
        return None
    return statistics.stdev(vals) if len(vals) > 1 else 0.0


def make_row(
    cfg: TrainConfig, v: Variant, runs: list[dict[str, Any]], partial: bool = False
) -> dict[str, Any]:
    """One variant's row: means over seeds (the runs' records kept under ``runs``)."""
    first = runs[0]
    row: dict[str, Any] = {
        "benchmark": "train",
        "task": cfg.task,
        "arch": cfg.arch if cfg.task == "shakespeare-char" else None,
        "level": v.label,
        "label": f"default ({first['actcore_level']})" if v.label == DEFAULT else v.label,
        "route": v.route,
        "actcore_level": first["actcore_level"],
        "seeds": [r["seed"] for r in runs],
        "steps": cfg.steps,
        "val_loss_mean": _mean([r["final_val_loss"] for r in runs]),
        "val_loss_std": _std([r["final_val_loss"] for r in runs]),
        "val_losses": [r["final_val_loss"] for r in runs],
        "accuracy_mean": _mean([r["final_accuracy"] for r in runs]),
        "accuracy_std": _std([r["final_accuracy"] for r in runs]),
        "accuracies": [r["final_accuracy"] for r in runs],
        "diverged": any(r["diverged_at_step"] for r in runs),
        "retained_bytes": first["retained_bytes"],  # seed 0's (adaptive plans can differ)
        "profiler_bytes": first["profiler_bytes"],
        "step_time_s": statistics.median(r["step_time_s"] for r in runs),
        "train_time_s": statistics.fmean(r["train_time_s"] for r in runs),
        "runs": runs,
    }
    if "memory_plan" in first:  # a budget variant: seed 0's plan
        row["memory_plan"] = first["memory_plan"]
    if SPECS[cfg.task].metric != "accuracy":
        for key in ("accuracy_mean", "accuracy_std", "accuracies"):
            row.pop(key)
    if partial:
        row["partial"] = True
    return row


def add_deltas(rows: list[dict[str, Any]]) -> None:
    """Fill in each row's difference to fp (val loss, accuracy points, bytes ratio)."""
    fp = next((r for r in rows if r["level"] == FP and not r.get("partial")), None)
    if fp is None:
        return
    for row in rows:
        if fp["val_loss_mean"] is not None and row["val_loss_mean"] is not None:
            row["delta_val_loss"] = row["val_loss_mean"] - fp["val_loss_mean"]
        if fp.get("accuracy_mean") is not None and row.get("accuracy_mean") is not None:
            row["delta_points"] = 100.0 * (row["accuracy_mean"] - fp["accuracy_mean"])
        key = _bytes_key(rows)
        if row.get(key) and fp.get(key):
            row["ratio"] = fp[key] / row[key]
        if fp["step_time_s"]:
            row["time_ratio"] = row["step_time_s"] / fp["step_time_s"]


def _bytes_key(rows: list[dict[str, Any]]) -> str:
    """The bytes the table shows: the tracker's, or the profiler's where the tracker could
    not see them (a compiled model's saves)."""
    tracked = all(r.get("retained_bytes") is not None for r in rows)
    return "retained_bytes" if tracked else "profiler_bytes"


def columns(task: str, rows: list[dict[str, Any]]) -> list[report.Column]:
    """Table columns (accuracy only for classification tasks, std only with several seeds)."""
    accuracy = SPECS[task].metric == "accuracy"
    cols = [
        report.Column("label", "level", justify="left"),
        report.Column("val_loss_mean", "val loss", report.fmt_float(4)),
        report.Column("delta_val_loss", "vs fp", lambda v: f"{v:+.4f}"),
    ]
    if any(len(r["seeds"]) > 1 for r in rows):
        cols.insert(2, report.Column("val_loss_std", "std", report.fmt_float(4)))
    if accuracy:
        cols += [
            report.Column("accuracy_mean", "test accuracy", lambda v: f"{100 * v:.2f}%"),
            report.Column("delta_points", "vs fp (points)", lambda v: f"{v:+.2f}"),
        ]
    cols += [
        report.Column(
            _bytes_key(rows),
            "held for backward" + ("" if _bytes_key(rows) == "retained_bytes" else " (profiler)"),
            report.fmt_bytes,
        ),
        report.Column("ratio", "fp / level", report.fmt_float(2, "x")),
        report.Column("step_time_s", "step ms", lambda v: f"{1000 * v:.1f}"),
        report.Column("time_ratio", "time / fp", report.fmt_float(2, "x")),
    ]
    if any(len(r["seeds"]) > 1 for r in rows):
        key, fmt = ("accuracies", "{:.1f}") if accuracy else ("val_losses", "{:.3f}")
        scale = 100 if accuracy else 1

        def per_seed(values: list[float | None]) -> str:
            return " ".join("-" if v is None else fmt.format(scale * v) for v in values)

        cols.append(report.Column(key, "per seed", per_seed))
    if any(r.get("diverged") for r in rows):
        cols.append(report.Column("diverged", "diverged", lambda v: "yes" if v else "no"))
    return cols


def title(cfg: TrainConfig) -> str:
    cfg = cfg.resolved()
    what = SPECS[cfg.task].summary
    if cfg.task == "shakespeare-char" and cfg.arch != "gpt":
        what = what.replace("GPT", f"GPT ({cfg.arch} style)")
    quick = ", quick" if cfg.quick else ""
    quick += ", torch.compile" if cfg.compile else ""
    return (
        f"{what}: {cfg.steps} steps, batch {cfg.batch}, {cfg.seeds} seed(s){quick} "
        f"({resolve_device(cfg.device)})"
    )


def show(cfg: TrainConfig, rows: list[dict[str, Any]]) -> None:
    report.console().print(report.table(title(cfg), columns(cfg.task, rows), rows))


def _mean_curve(runs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and the mean of ``key`` over runs at the steps every run reached.

    ``key`` is a field of the evaluation points, or ``train_loss`` (the logged means).
    """
    by_step: dict[int, list[float]] = {}
    for r in runs:
        if key == "train_loss":
            points = [(int(s), v) for s, v in r["train_curve"]]
        else:
            points = [(p["step"], p.get(key)) for p in r["curve"]]
        for step, value in points:
            if value is not None and math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(s for s, vals in by_step.items() if len(vals) == len(runs))
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def _zoom(ax: Any, ends: list[list[float]], lower: float, margin: float) -> None:
    """Limit ``ax``'s y range to the second half of training (``ends``: each curve's)."""
    ends = [e for e in ends if e]
    if ends:
        low = min(min(e) for e in ends)
        high = max(e[-1] for e in ends)
        ax.set_ylim(max(lower, low - 0.1 * margin), high + margin + 0.5 * (high - low))


def figure(cfg: TrainConfig, rows: list[dict[str, Any]]) -> Any:
    """Training loss (left) and validation loss or test accuracy (right) against step."""
    Figure = report.optional_import("matplotlib.figure").Figure

    cfg = cfg.resolved()
    fig = Figure(figsize=(11, 4.2), dpi=120)
    left, right = fig.subplots(1, 2)
    accuracy = SPECS[cfg.task].metric == "accuracy"
    right_key = "accuracy" if accuracy else "val_loss"
    ends: dict[str, list[list[float]]] = {"train_loss": [], right_key: []}
    for row in rows:
        style: dict[str, Any] = {"linewidth": 1.4}
        if row["level"] == FP:
            style = {"color": "black", "linewidth": 2.2, "zorder": 5}
        elif row["level"] == DEFAULT:  # often the same as a listed level: keep both visible
            style["linestyle"] = "--"
        for ax, key in ((left, "train_loss"), (right, right_key)):
            xs, ys = _mean_curve(row["runs"], key)
            if key == "accuracy":
                ys = [100 * y for y in ys]
            ax.plot(xs, ys, label=row["label"], **style)
            ends[key].append(ys[len(ys) // 2 :])
    seeds = f"mean of {cfg.seeds} seeds" if cfg.seeds > 1 else "seed 0"
    left.set_title(f"training loss ({seeds})", fontsize=9)
    left.set_ylabel("cross-entropy")
    _zoom(left, ends["train_loss"], 0.0, 0.3 if not accuracy else 0.5)
    if accuracy:
        right.set_title(f"test accuracy ({seeds})", fontsize=9)
        right.set_ylabel("%")
        if any(ends["accuracy"]):
            right.set_ylim(min(e[-1] for e in ends["accuracy"] if e) - 10, 100)
    else:
        right.set_title(f"validation loss, held-out works ({seeds})", fontsize=9)
        right.set_ylabel("cross-entropy")
        _zoom(right, ends["val_loss"], 0.0, 0.3)
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title(cfg), fontsize=10)
    fig.tight_layout()
    return fig


def plot(cfg: TrainConfig, rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Save :func:`figure` as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(cfg, rows).savefig(path)
    return path
