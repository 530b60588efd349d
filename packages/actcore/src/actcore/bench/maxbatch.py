"""``actcore bench max-batch`` (CUDA): the largest batch one training step fits in, per level.

Doubles the batch from ``--start`` until a step raises ``torch.OutOfMemoryError`` (or
``--limit`` is passed), then bisects between the last batch that fitted and the first that
did not. Each level gets a fresh model; the step is forward + backward with random data.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import report
from .memory import AMP_DTYPES, positive_int, resolve_device, split_items
from .models import build_model, check_model, default_image_size, logits
from .routes import FP, applied, chosen_levels

__all__ = [
    "COLUMNS",
    "EXIT_NO_GPU",
    "MaxBatchConfig",
    "fits",
    "main",
    "no_gpu_message",
    "on_cuda_or_explain",
    "register",
    "run",
    "search",
]

EXIT_NO_GPU = 2


def no_gpu_message(name: str, hint: str) -> str:
    """The message a GPU-only benchmark prints when it cannot run on CUDA."""
    if torch.cuda.is_available():
        why = "a non-CUDA --device was given"
    else:
        why = "torch sees none on this machine (torch.cuda.is_available() is False)"
    return f"actcore bench {name} needs a CUDA GPU, and {why}. {hint}"


def on_cuda_or_explain(device: torch.device, name: str, hint: str) -> bool:
    """Whether ``device`` is a usable CUDA device; if not, say why on stderr."""
    if device.type == "cuda" and torch.cuda.is_available():
        return True
    report.console(stderr=True).print(no_gpu_message(name, hint), markup=False)
    return False


@dataclass
class MaxBatchConfig:
    """What ``bench max-batch`` searches."""

    model: str = "resnet50"
    levels: list[str] = field(default_factory=lambda: ["fp", "L3"])
    route: str = "layers"
    amp: str = "none"
    image_size: int | None = None
    start: int = 8
    limit: int = 1 << 16
    device: str = "cuda"


def fits(model: nn.Module, shape: tuple[int, ...], classes: int, batch: int, cfg: MaxBatchConfig):
    """Seconds one step at ``batch`` takes, or None if it runs out of memory."""
    device = resolve_device(cfg.device)
    amp = AMP_DTYPES[cfg.amp]
    oom = False
    seconds = None
    try:
        x = torch.randn(batch, *shape, device=device)
        y = torch.randint(0, classes, (batch,), device=device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = logits(model(x))
        nn.functional.cross_entropy(out.float(), y).backward()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        oom = True  # cleaned up below, once the exception (and its frames) are gone
    x = y = out = None  # drop the references before emptying the cache
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return None if oom else seconds


def search(cfg: MaxBatchConfig, level: str, advance: Callable[..., None]) -> dict[str, Any]:
    """Largest batch for ``level``: doubling, then bisection."""
    device = resolve_device(cfg.device)
    torch.manual_seed(0)
    size = cfg.image_size or default_image_size(cfg.model)
    model, shape, classes = build_model(cfg.model, image_size=size)
    model.to(device)
    tries: list[tuple[int, bool]] = []

    def attempt(batch: int) -> float | None:
        advance(0, description=f"{cfg.model} {level} batch {batch}")
        seconds = fits(model, shape, classes, batch, cfg)
        tries.append((batch, seconds is not None))
        return seconds

    with applied(model, level, cfg.route):
        good, good_time, batch = 0, None, cfg.start
        while batch <= cfg.limit:
            seconds = attempt(batch)
            if seconds is None:
                break
            good, good_time, batch = batch, seconds, batch * 2
        bad = min(batch, cfg.limit + 1)
        while bad - good > 1:
            mid = (good + bad) // 2
            seconds = attempt(mid)
            if seconds is None:
                bad = mid
            else:
                good, good_time = mid, seconds
    return {
        "benchmark": "max-batch",
        "model": cfg.model,
        "level": level,
        "route": cfg.route,
        "image_size": size,
        "amp": cfg.amp,
        "max_batch": good,
        "hit_limit": good >= cfg.limit,
        "step_time_s": good_time,
        "throughput": good / good_time if good and good_time else None,
        "tries": [{"batch": b, "fits": ok} for b, ok in tries],
    }


def run(
    cfg: MaxBatchConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    fp_batch = None
    for level in cfg.levels:
        row = search(cfg, level, advance)
        gc.collect()  # the level's model is gone: give its memory back
        torch.cuda.empty_cache()
        if level == FP:
            fp_batch = row["max_batch"]
        if fp_batch:
            row["ratio"] = row["max_batch"] / fp_batch
        rows.append(row)
        advance(1)


COLUMNS = [
    report.Column("level", "level", justify="left"),
    report.Column("max_batch", "max batch"),
    report.Column("ratio", "vs fp", report.fmt_float(2, "x")),
    report.Column("throughput", "samples/s at max", report.fmt_float(1)),
    report.Column("hit_limit", "hit --limit", lambda v: "yes" if v else "no"),
]


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench max-batch``."""
    p = subparsers.add_parser(
        "max-batch",
        help="(CUDA) largest batch that fits in GPU memory, per level",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="resnet50")
    p.add_argument(
        "--levels",
        "--level",
        dest="levels",
        default=None,
        help="comma-separated (default fp,L3; fp,G3 with --route hooks)",
    )
    p.add_argument("--route", choices=["layers", "hooks"], default="layers")
    p.add_argument("--amp", choices=list(AMP_DTYPES), default="none")
    p.add_argument("--image-size", type=positive_int, default=None)
    p.add_argument("--start", type=positive_int, default=8, help="first batch tried (default 8)")
    p.add_argument("--limit", type=positive_int, default=1 << 16, help="largest batch tried")
    p.add_argument("--device", default="cuda")
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _validate(args: argparse.Namespace) -> None:
    check_model(args.model)
    given = None if args.levels is None else split_items(args.levels)
    args.levels = chosen_levels(given, "fp,L3", args.route)


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    hint = (
        "On a CPU, `actcore bench memory` measures the activation memory each level "
        "saves, which is what lets a larger batch fit."
    )
    if not on_cuda_or_explain(device, "max-batch", hint):
        return EXIT_NO_GPU
    cfg = report.config_from_args(MaxBatchConfig, args)
    title = (
        f"{cfg.model}, {cfg.image_size or default_image_size(cfg.model)}px, route {cfg.route}: "
        f"largest batch on {torch.cuda.get_device_name(device)}"
    )
    return report.run_with_progress(
        "max-batch",
        args,
        len(cfg.levels),
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg),
        show=lambda rows: report.console().print(report.table(title, COLUMNS, rows)),
    )
