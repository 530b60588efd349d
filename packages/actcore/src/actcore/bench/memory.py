"""``actcore bench memory``: activation bytes held for backward, step time and throughput.

For each level a fresh model (same seed, random weights) runs one tracked forward
(:func:`actcore.memory.track` counts what autograd keeps for backward) and backward, then
``--steps`` timed training steps (forward + backward), then one step under the profiler
(its ATen calls, against fp's, and those that synchronise with the host; adaptive levels
take statistics on every step before their first replan, so these are such a step's: the
table's ``calls on`` column and the row's ``aten_step`` say ``stats`` / ``statistics``).
``fp`` is the plain PyTorch model: every ratio is ``fp bytes / level bytes``, and it is
measured first whether listed or not.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .. import memory as act_memory
from . import report
from .calls import count_calls
from .models import build_model, default_image_size, logits
from .routes import FP, applied

__all__ = [
    "AMP_DTYPES",
    "MemoryConfig",
    "columns",
    "main",
    "measure_level",
    "register",
    "resolve_device",
    "run",
    "show",
    "sync_device",
    "title",
]

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MemoryConfig:
    """What ``bench memory`` measures."""

    model: str = "resnet50"
    batch: int = 32
    levels: list[str] = field(default_factory=lambda: ["L0", "L1", "L2", "L3"])
    route: str = "layers"
    amp: str = "none"
    image_size: int | None = None
    steps: int = 3
    device: str = "auto"
    seed: int = 0

    def resolved_levels(self) -> list[str]:
        """``levels`` with ``fp`` first (the reference of every ratio), each once."""
        return [FP, *dict.fromkeys(lv for lv in self.levels if lv != FP)]


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None
) -> torch.Tensor:
    """One forward + backward; returns the loss (detached)."""
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        out = logits(model(x))
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def measure_level(cfg: MemoryConfig, level: str, device: torch.device) -> dict[str, Any]:
    """One row: the bytes held for backward and the step time of ``cfg.model`` at ``level``."""
    torch.manual_seed(cfg.seed)
    size = cfg.image_size or default_image_size(cfg.model)
    model, shape, num_classes = build_model(cfg.model, image_size=size)
    model.to(device)
    x = torch.randn(cfg.batch, *shape, device=device)
    y = torch.randint(0, num_classes, (cfg.batch,), device=device)
    amp = AMP_DTYPES[cfg.amp]
    row: dict[str, Any] = {
        "benchmark": "memory",
        "model": cfg.model,
        "level": level,
        "route": cfg.route,
        "batch": cfg.batch,
        "image_size": size,
        "amp": cfg.amp,
        "device": str(device),
    }
    with applied(model, level, cfg.route) as after_step:

        def backprop() -> None:
            _step(model, x, y, amp)

        if after_step is not None:  # hooks route: adaptive policies plan before the measure
            after_step(backprop)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        autocast = torch.autocast(device.type, dtype=amp, enabled=amp is not None)
        with act_memory.track(model) as mem, autocast:
            out = logits(model(x))
        loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        del out, loss
        model.zero_grad(set_to_none=True)
        sync_device(device)
        row["retained_bytes"] = mem.retained_bytes
        # on the model's device (L4/swap move the rest to host memory: only CUDA shows it)
        row["device_bytes"] = sum(
            n for d, n in mem.by_device.items() if torch.device(d).type == device.type
        )
        row["gpu_peak_bytes"] = (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        )
        times = []
        for _ in range(cfg.steps):
            sync_device(device)
            t0 = time.perf_counter()
            backprop()
            sync_device(device)
            times.append(time.perf_counter() - t0)
            if after_step is not None:
                after_step(backprop)
        # one more step's ATen calls (GPU kernel launches) and device-to-host syncs; under
        # adaptive bits, a step before the first replan (or in a window) takes statistics
        scheme = getattr(model, "act_adaptive", None)
        row["aten_step"] = "statistics" if scheme is not None and scheme.collecting() else "steady"
        row["aten_calls"], syncs = count_calls(backprop)
        row["sync_calls"] = sum(syncs.values())
    step = statistics.median(times) if times else None
    row["step_time_s"] = step
    row["throughput"] = cfg.batch / step if step else None
    return row


def run(
    cfg: MemoryConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Append one row per level to ``rows`` (fp first), filling in ratios to fp."""
    device = resolve_device(cfg.device)
    fp_bytes = fp_calls = None
    for level in cfg.resolved_levels():
        advance(0, description=f"{cfg.model} {level}")
        try:
            row = measure_level(cfg, level, device)
        except torch.OutOfMemoryError:
            row = {
                "benchmark": "memory",
                "model": cfg.model,
                "level": level,
                "route": cfg.route,
                "batch": cfg.batch,
                "error": "out of memory",
            }
            gc.collect()
            torch.cuda.empty_cache()
        if level == FP and "retained_bytes" in row:
            fp_bytes, fp_calls = row["retained_bytes"], row.get("aten_calls")
        if fp_calls and row.get("aten_calls"):
            row["aten_ratio"] = row["aten_calls"] / fp_calls
        held = row.get("retained_bytes")
        if fp_bytes and held:
            row["ratio"] = fp_bytes / held
            row["saved_fraction"] = 1.0 - held / fp_bytes
        rows.append(row)
        advance(1)


_STEP_KIND = {"steady": "steady", "statistics": "stats"}  # (what the calls were counted on)


def columns(cuda: bool, errors: bool = False) -> list[report.Column]:
    """Table columns; GPU peak only on CUDA, the error column only when a level failed."""
    cols = [
        report.Column("level", "level", justify="left"),
        report.Column("retained_bytes", "held for backward", report.fmt_bytes),
        report.Column("ratio", "fp / level", report.fmt_float(1, "x")),
        report.Column("saved_fraction", "saved", lambda v: f"{100 * v:.1f}%"),
        report.Column("step_time_s", "step (fwd+bwd) s", report.fmt_float(3)),
        report.Column("throughput", "samples/s", report.fmt_float(1)),
        report.Column("aten_calls", "ATen calls/step", report.fmt_float(0)),
        report.Column("aten_ratio", "calls vs fp", report.fmt_float(1, "x")),
        report.Column("aten_step", "calls on", lambda v: _STEP_KIND.get(v, "-"), "left"),
        report.Column("sync_calls", "syncs/step", report.fmt_float(0)),
    ]
    if cuda:
        cols.insert(2, report.Column("device_bytes", "of it on GPU", report.fmt_bytes))
        cols.append(report.Column("gpu_peak_bytes", "GPU peak", report.fmt_bytes))
    if errors:
        cols.append(report.Column("error", "error", justify="left"))
    return cols


def title(cfg: MemoryConfig) -> str:
    size = cfg.image_size or default_image_size(cfg.model)
    amp = "" if cfg.amp == "none" else f", autocast {cfg.amp}"
    return (
        f"{cfg.model}, batch {cfg.batch}, {size}x{size}, route {cfg.route}{amp} "
        f"({resolve_device(cfg.device)}): activation memory held for backward"
    )


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench memory``."""
    p = subparsers.add_parser(
        "memory",
        help="activation memory held for backward, step time and throughput per level",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="resnet50", help="torchvision or built-in model name")
    p.add_argument("--batch", type=positive_int, default=32, help="batch size (default 32)")
    p.add_argument(
        "--levels",
        default=None,
        help="comma-separated levels (default L0,L1,L2,L3; G0,G1,G2,G3 with --route hooks; fp "
        "is always measured as the reference)",
    )
    p.add_argument("--route", choices=["layers", "hooks"], default="layers")
    p.add_argument("--amp", choices=list(AMP_DTYPES), default="none", help="autocast dtype")
    p.add_argument("--image-size", type=positive_int, default=None, help="input height and width")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per level")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    p.add_argument("--seed", type=int, default=0)
    common(p)
    p.set_defaults(func=main, validate=_validate)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _validate(args: argparse.Namespace) -> None:
    from .routes import chosen_levels

    given = None if args.levels is None else split_items(args.levels)
    args.levels = chosen_levels(given, "L0,L1,L2,L3", args.route)
    from .models import check_model

    check_model(args.model)
    resolve_device(args.device)


def split_items(text: str | list[str]) -> list[str]:
    if isinstance(text, list):
        return text
    return [part.strip() for part in text.split(",") if part.strip()]


def show(cfg: MemoryConfig, rows: list[dict[str, Any]]) -> None:
    cuda = resolve_device(cfg.device).type == "cuda"
    errors = any("error" in r for r in rows)
    report.console().print(report.table(title(cfg), columns(cuda, errors), rows))


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(MemoryConfig, args)
    return report.run_with_progress(
        "memory",
        args,
        len(cfg.resolved_levels()),
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg),
        show=lambda rows: show(cfg, rows),
    )
