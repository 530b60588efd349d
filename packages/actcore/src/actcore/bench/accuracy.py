"""``actcore bench accuracy``: test accuracy kept, per level, on a small real data set.

The task ``digits`` is scikit-learn's handwritten digits (1797 8x8 images, shipped with
scikit-learn: nothing is downloaded), split once into 1347 training and 450 test images
(stratified, fixed). For each level and seed a small CNN (same initialisation per seed for
every level) is trained with Adam and evaluated; the rows give mean and std over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..ops import reset_seed_stream
from . import report
from .models import digits_cnn
from .routes import FP, applied

__all__ = [
    "COLUMNS",
    "TASKS",
    "AccuracyConfig",
    "Split",
    "load_task",
    "main",
    "register",
    "run",
    "show",
    "title",
    "train_once",
]

TASKS = ("digits",)


@dataclass
class AccuracyConfig:
    """What ``bench accuracy`` trains."""

    task: str = "digits"
    levels: list[str] = field(default_factory=lambda: ["fp", "L2", "L3"])
    seeds: int = 3
    epochs: int = 8
    batch: int = 32
    lr: float = 2e-3
    route: str = "layers"


@dataclass
class Split:
    """Train and test tensors of a task."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_task(task: str) -> Split:
    """The fixed train/test split of ``task`` (ValueError listing the tasks if unknown)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise RuntimeError(
            "the digits task needs scikit-learn: pip install 'actcore[bench]'"
        ) from err
    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.images, data.target, test_size=450, random_state=0, stratify=data.target
    )
    mean, std = x_tr.mean(), x_tr.std()

    def images(a: Any) -> torch.Tensor:
        return torch.as_tensor((a - mean) / std, dtype=torch.float32).unsqueeze(1)

    def labels(a: Any) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long)

    return Split(images(x_tr), labels(y_tr), images(x_te), labels(y_te))


def train_once(cfg: AccuracyConfig, split: Split, level: str, seed: int) -> float:
    """Train the digits CNN at ``level`` from ``seed``; returns the test accuracy (0..1)."""
    torch.manual_seed(seed)
    reset_seed_stream()  # the same stochastic rounding for the same seed, run after run
    model = digits_cnn(10)
    gen = torch.Generator().manual_seed(seed)
    n = len(split.y_train)
    with applied(model, level, cfg.route) as after_step:
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs * -(-n // cfg.batch))
        for _ in range(cfg.epochs):
            model.train()
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, cfg.batch):
                idx = order[start : start + cfg.batch]
                x, y = split.x_train[idx], split.y_train[idx]

                def backprop(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(model(x), y).backward()

                backprop()
                opt.step()
                sched.step()
                if after_step is not None:
                    after_step(backprop)
        model.eval()
        with torch.no_grad():
            pred = model(split.x_test).argmax(1)
    return (pred == split.y_test).float().mean().item()


def run(
    cfg: AccuracyConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Append one row per level (mean/std over seeds) to ``rows``."""
    split = load_task(cfg.task)
    fp_mean = None
    for level in cfg.levels:
        accs: list[float] = []
        t0 = time.perf_counter()
        try:
            for seed in range(cfg.seeds):
                advance(0, description=f"{cfg.task} {level} seed {seed}")
                accs.append(train_once(cfg, split, level, seed))
                advance(1)
        except KeyboardInterrupt:
            if accs:  # keep the seeds that finished, marked partial
                rows.append(_row(cfg, level, accs, t0, fp_mean, partial=True))
            raise
        row = _row(cfg, level, accs, t0, fp_mean)
        if level == FP:
            fp_mean = row["accuracy_mean"]
            row["delta_points"] = 0.0
        rows.append(row)


def _row(
    cfg: AccuracyConfig,
    level: str,
    accs: list[float],
    t0: float,
    fp_mean: float | None,
    partial: bool = False,
) -> dict[str, Any]:
    mean = statistics.fmean(accs)
    row: dict[str, Any] = {
        "benchmark": "accuracy",
        "task": cfg.task,
        "level": level,
        "route": cfg.route,
        "accuracy_mean": mean,
        "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "accuracies": accs,
        "seeds": list(range(len(accs))),
        "epochs": cfg.epochs,
        "train_time_s": (time.perf_counter() - t0) / len(accs),
    }
    if fp_mean is not None:
        row["delta_points"] = 100.0 * (mean - fp_mean)
    if partial:
        row["partial"] = True
    return row


def _pct(v: float) -> str:
    return f"{100 * v:.2f}%"


COLUMNS = [
    report.Column("level", "level", justify="left"),
    report.Column("accuracy_mean", "test accuracy", _pct),
    report.Column("accuracy_std", "std", lambda v: f"{100 * v:.2f}"),
    report.Column("delta_points", "vs fp (points)", lambda v: f"{v:+.2f}"),
    report.Column("accuracies", "per seed", lambda v: " ".join(f"{100 * a:.1f}" for a in v)),
    report.Column("train_time_s", "train s/seed", report.fmt_float(1)),
]


def title(cfg: AccuracyConfig) -> str:
    return (
        f"{cfg.task}: small CNN, {cfg.epochs} epochs, {cfg.seeds} seed(s), "
        f"route {cfg.route}: test accuracy per level"
    )


def show(cfg: AccuracyConfig, rows: list[dict[str, Any]]) -> None:
    report.console().print(report.table(title(cfg), COLUMNS, rows))


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench accuracy``."""
    from .memory import positive_int

    p = subparsers.add_parser(
        "accuracy",
        help="test accuracy per level on sklearn's digits (mean/std over seeds)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", choices=TASKS, default="digits")
    p.add_argument(
        "--levels",
        default=None,
        help="comma-separated levels, fp: no ACT (default fp,L2,L3; fp,G2,G3 with --route hooks)",
    )
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--epochs", type=positive_int, default=AccuracyConfig.epochs)
    p.add_argument("--batch", type=positive_int, default=AccuracyConfig.batch)
    p.add_argument("--lr", type=float, default=AccuracyConfig.lr)
    p.add_argument("--route", choices=["layers", "hooks"], default="layers")
    common(p)
    p.set_defaults(func=main, validate=_validate, threads=1)  # a tiny CNN: 1 thread is best


def _validate(args: argparse.Namespace) -> None:
    from .memory import split_items
    from .routes import chosen_levels

    given = None if args.levels is None else split_items(args.levels)
    args.levels = chosen_levels(given, "fp,L2,L3", args.route)


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(AccuracyConfig, args)
    return report.run_with_progress(
        "accuracy",
        args,
        len(cfg.levels) * cfg.seeds,
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg),
        show=lambda rows: show(cfg, rows),
    )
