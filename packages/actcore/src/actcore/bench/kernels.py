"""``actcore bench kernels`` (CUDA): bandwidth of ``ops.quantize`` / ``ops.dequantize``.

Each op's bandwidth is the bytes it must read and write (full-precision tensor plus the
packed payload and per-group metadata, ``Packed.nbytes``) over its median time per call
(CUDA events around 8 calls launched back to back), shown as GB/s and as a percentage of
the device copy bandwidth measured here (``y.copy_(x)``, 2 x the tensor's bytes moved).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import ops
from ..ops.api import check_group_size
from . import report
from .maxbatch import EXIT_NO_GPU, on_cuda_or_explain
from .memory import positive_int, split_items

__all__ = ["COLUMNS", "DTYPES", "KernelConfig", "main", "register", "run", "time_cuda"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class KernelConfig:
    """What ``bench kernels`` times."""

    sizes: list[int] = field(default_factory=lambda: [1 << 20, 1 << 24, 1 << 26])
    bits: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    dtype: str = "fp32"
    group_size: int = 256
    iters: int = 20
    device: str = "cuda"


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int = 3, batch: int = 8) -> float:
    """Median seconds per ``fn()`` on the current CUDA stream, over ``iters`` timings of
    ``batch`` calls launched back to back: the device time of the kernels, not the host's
    time to launch one call (for a single call between two events, a kernel shorter than
    the Python front end would be timed at the front end's speed)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(times)


def run(
    cfg: KernelConfig,
    rows: list[dict[str, Any]],
    advance: Callable[..., None] = lambda *a, **k: None,
) -> None:
    """Append rows (copy, then quantize, dequantize and nearest-rounding quantize per bits)
    for each size."""
    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    for n in cfg.sizes:
        x = torch.randn(n // cfg.group_size or 1, cfg.group_size, device=device, dtype=dtype)
        full = x.numel() * x.element_size()
        y = torch.empty_like(x)
        t = time_cuda(lambda x=x, y=y: y.copy_(x), cfg.iters)
        copy_bw = 2 * full / t
        base = {"benchmark": "kernels", "numel": x.numel(), "dtype": cfg.dtype}
        rows.append(
            {
                **base,
                "op": "copy",
                "bits": None,
                "seconds": t,
                "gb_per_s": copy_bw / 1e9,
                "pct_of_copy": 100.0,
            }
        )
        del y
        for bits in cfg.bits:
            advance(0, description=f"{x.numel()} elements, {bits} bits")
            packed = ops.quantize(x, bits, group_size=cfg.group_size, seed=0)
            moved = full + packed.nbytes
            tq = time_cuda(
                lambda x=x, b=bits: ops.quantize(x, b, group_size=cfg.group_size, seed=0),
                cfg.iters,
            )
            td = time_cuda(lambda p=packed: ops.dequantize(p), cfg.iters)
            # round to nearest: the same kernel without the per-element noise hash
            tn = time_cuda(
                lambda x=x, b=bits: ops.quantize(x, b, group_size=cfg.group_size, stochastic=False),
                cfg.iters,
            )
            for op, t in (("quantize", tq), ("dequantize", td), ("quantize-nearest", tn)):
                rows.append(
                    {
                        **base,
                        "op": op,
                        "bits": bits,
                        "seconds": t,
                        "gb_per_s": moved / t / 1e9,
                        "pct_of_copy": 100.0 * moved / t / copy_bw,
                    }
                )
            advance(1)
        del x
        torch.cuda.empty_cache()


COLUMNS = [
    report.Column("numel", "elements"),
    report.Column("op", "op", justify="left"),
    report.Column("bits", "bits"),
    report.Column("seconds", "time us", lambda v: f"{v * 1e6:.1f}"),
    report.Column("gb_per_s", "GB/s", report.fmt_float(1)),
    report.Column("pct_of_copy", "% of copy", report.fmt_float(1, "%")),
]


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench kernels``."""
    p = subparsers.add_parser(
        "kernels",
        help="(CUDA) GB/s of quantize/dequantize as a share of measured copy bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default="1048576,16777216,67108864", help="elements per tensor")
    p.add_argument("--bits", default="1,2,4,8", help="comma-separated bits in 1..8")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--group-size", type=positive_int, default=256)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--device", default="cuda")
    common(p)
    p.set_defaults(func=main, validate=_validate)


def _ints(text: str | list[int], name: str, low: int, high: int | None = None) -> list[int]:
    if isinstance(text, list):
        return text
    try:
        values = [int(v) for v in split_items(text)]
    except ValueError:
        values = []
    if not values or any(v < low or (high is not None and v > high) for v in values):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} takes comma-separated integers in {allowed}, got {text!r}")
    return values


def _validate(args: argparse.Namespace) -> None:
    args.sizes = _ints(args.sizes, "--sizes", 1)
    args.bits = _ints(args.bits, "--bits", 1, 8)
    check_group_size(args.group_size)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    hint = (
        "On a CPU the ops run actcore's C++ CPU kernels; `actcore bench memory` "
        "shows what they save."
    )
    if not on_cuda_or_explain(device, "kernels", hint):
        return EXIT_NO_GPU
    cfg = report.config_from_args(KernelConfig, args)
    title = (
        f"actcore.ops on {torch.cuda.get_device_name(device)}, {cfg.dtype}, group {cfg.group_size}"
    )
    return report.run_with_progress(
        "kernels",
        args,
        len(cfg.sizes) * len(cfg.bits),
        lambda rows, advance: run(cfg, rows, advance),
        config=asdict(cfg),
        show=lambda rows: report.console().print(report.table(title, COLUMNS, rows)),
    )
