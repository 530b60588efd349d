"""GNN benchmark: accuracy, activation memory and epoch time, full precision vs compressed.

    python -m act_pyg.bench --model gcn|sage|gat|gin [--style module|example] [--level L3]
        [--get-mem | --memory-only] [--epochs 100] [--seeds 3] [--random-projection 0.125]
        [--nodes 3000] [--features 128] [--hidden 64] [--data PATH] [--device cpu]

Trains a 2-layer model (activations and dropout as modules, or written as PyG's examples
write them, with functional calls in ``forward``) on a graph that builds offline (a
planted-partition graph with class-dependent features, made here from a seed), or on a
``torch_geometric.data.Data`` saved with ``torch.save`` (``--data``; it needs ``x``, ``y``,
``edge_index`` and, if it has them, ``train_mask``/``test_mask``). Each seed trains the
same initialisation twice, in full precision and converted, and reports the final test
accuracy of both; ``--get-mem`` also measures the bytes one training forward leaves held
for backward (``actcore.memory``, and the CPU profiler as an independent check).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch_geometric
from torch import nn
from torch_geometric.data import Data

from actcore import memory
from actcore.bench import report
from actcore.extend import LEVELS, level_spec

from .bench_data import PLANTED, SMALL_GRAPH, load_data, planted_partition, random_graph
from .bench_models import (
    EXAMPLE_ACT,
    EXAMPLES,
    GNN,
    MODELS,
    STYLES,
    ExampleGAT,
    ExampleGCN,
    ExampleGIN,
    ExampleSAGE,
    build_model,
    make_model,
)
from .convert import convert

__all__ = [
    "EXAMPLES",
    "EXAMPLE_ACT",
    "GNN",
    "MODELS",
    "PLANTED",
    "SMALL_GRAPH",
    "SMALL_RUN",
    "STYLES",
    "BenchResult",
    "ExampleGAT",
    "ExampleGCN",
    "ExampleGIN",
    "ExampleSAGE",
    "RunResult",
    "build_model",
    "format_result",
    "held_bytes",
    "load_data",
    "main",
    "make_model",
    "planted_partition",
    "random_graph",
    "retained_bytes",
    "run",
]

# A quick configuration (the accuracy test): about 10 s of CPU for all three models.
SMALL_RUN = {"epochs": 50, "hidden": 32, "dropout": 0.2}


@dataclass
class RunResult:
    """One training run."""

    seed: int
    accuracy: float
    epoch_seconds: float


@dataclass
class BenchResult:
    """What :func:`run` measured, full precision vs compressed."""

    model: str
    level: str
    random_projection: float | None
    data: str
    device: str
    epochs: int
    style: str = "module"
    fp: list[RunResult] = field(default_factory=list)
    act: list[RunResult] = field(default_factory=list)
    fp_retained_bytes: int | None = None
    act_retained_bytes: int | None = None
    # what the CPU profiler saw the same forward leave allocated (output included)
    fp_profiled_bytes: int | None = None
    act_profiled_bytes: int | None = None

    @property
    def fp_accuracy(self) -> float:
        return statistics.fmean(r.accuracy for r in self.fp)

    @property
    def act_accuracy(self) -> float:
        return statistics.fmean(r.accuracy for r in self.act)


def _train(
    model: nn.Module, data: Data, epochs: int, lr: float, weight_decay: float
) -> tuple[float, float]:
    """Train full-batch with Adam; (test accuracy, mean seconds per epoch)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if data.x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(epochs):
        model.train()
        opt.zero_grad(set_to_none=True)
        out = model(data.x, data.edge_index)
        loss = loss_fn(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
    sync()
    elapsed = (time.perf_counter() - start) / max(epochs, 1)
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    mask = data.test_mask
    acc = (pred[mask] == data.y[mask]).float().mean().item()
    return acc, elapsed


def retained_bytes(model: nn.Module, data: Data) -> int:
    """Bytes one training forward leaves held for backward (actcore.memory)."""
    return held_bytes(model, data, profile=False)[0]


def held_bytes(model: nn.Module, data: Data, *, profile: bool = True) -> tuple[int, int | None]:
    """One training forward: (bytes held for backward by ``actcore.memory``, bytes the CPU
    profiler saw it leave allocated, output included; None off CPU or without ``profile``).

    The profiler's sum of ``self_cpu_memory_usage`` is an independent measure: it differs
    from the held bytes only by the output (allocated, not saved) and the saved tensors that
    existed before the forward (inputs such as an ``edge_index`` that a layer saves).
    """
    model.train()
    profile = profile and data.x.device.type == "cpu"
    if profile:  # warm-up: one-time lazy allocations stay out of the measured window
        torch.manual_seed(0)
        del_out = model(data.x, data.edge_index)
        del del_out
        gc.collect()
    with contextlib.ExitStack() as stack:
        prof = None
        if profile:
            prof = stack.enter_context(
                torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                )
            )
        report = stack.enter_context(memory.track(model))
        torch.manual_seed(0)
        out = model(data.x, data.edge_index)
    allocated = None if prof is None else sum(e.self_cpu_memory_usage for e in prof.events())
    del out
    return report.retained_bytes, allocated


def run(
    kind: str,
    data: Data,
    *,
    level: str = "L3",
    epochs: int = 100,
    seeds: Sequence[int] = (0, 1, 2),
    random_projection: float | None = None,
    get_mem: bool = False,
    hidden: int = 64,
    dropout: float = 0.5,
    lr: float = 0.01,
    weight_decay: float = 5e-4,
    device: str = "cpu",
    style: str = "module",
) -> BenchResult:
    """Train ``kind`` (in ``style``) on ``data`` per seed, full precision and converted from
    the same initialisation; with ``get_mem`` measure one training forward's held bytes
    (``seeds=()``: only that)."""
    level = level_spec(level).name
    data = data.to(device)
    result = BenchResult(
        kind,
        level,
        random_projection,
        getattr(data, "source", "user data"),
        device,
        epochs,
        style,
    )

    def pair(seed: int) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(seed)
        fp = build_model(kind, data, hidden, dropout=dropout, style=style).to(device)
        return fp, convert(copy.deepcopy(fp), level, random_projection=random_projection)

    for seed in seeds:
        for model, runs in zip(pair(seed), (result.fp, result.act), strict=True):
            torch.manual_seed(seed)  # the same dropout stream for both
            acc, sec = _train(model, data, epochs, lr, weight_decay)
            runs.append(RunResult(seed, acc, sec))
    if get_mem:
        fp, act = pair(0)
        result.fp_retained_bytes, result.fp_profiled_bytes = held_bytes(fp, data)
        result.act_retained_bytes, result.act_profiled_bytes = held_bytes(act, data)
    return result


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def format_result(r: BenchResult) -> str:
    rp = "off" if r.random_projection is None else f"{r.random_projection}"
    lines = [
        f"model {r.model} ({r.style} style), level {r.level}, random projection {rp}, "
        f"device {r.device}",
        f"data: {r.data}",
    ]
    if r.fp:
        lines.append(f"{len(r.fp)} seed(s) x {r.epochs} epochs; final test accuracy, epoch time")
    lines.append(f"{'':<14}{'accuracy':>10}{'epoch ms':>10}{'held MiB':>10}{'profiler':>10}")
    for label, runs, mem, prof in (
        ("fp32", r.fp, r.fp_retained_bytes, r.fp_profiled_bytes),
        (f"act {r.level}", r.act, r.act_retained_bytes, r.act_profiled_bytes),
    ):
        acc = f"{statistics.fmean(x.accuracy for x in runs) * 100:.2f}%" if runs else "-"
        ms = f"{statistics.fmean(x.epoch_seconds for x in runs) * 1e3:.1f}" if runs else "-"
        lines.append(f"{label:<14}{acc:>10}{ms:>10}{_mib(mem):>10}{_mib(prof):>10}")
    if r.fp_retained_bytes and r.act_retained_bytes:
        ratio = r.fp_retained_bytes / r.act_retained_bytes
        line = f"activation memory held for backward: {ratio:.1f}x smaller"
        if r.fp_profiled_bytes and r.act_profiled_bytes:
            line += (
                f" ({r.fp_profiled_bytes / r.act_profiled_bytes:.1f}x by the CPU profiler:"
                " what one forward left allocated, output included)"
            )
        lines.append(line)
    if r.fp:
        diff = (r.act_accuracy - r.fp_accuracy) * 100
        lines.append(f"accuracy difference (act - fp): {diff:+.2f} points")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m act_pyg.bench", description=__doc__)
    parser.add_argument(
        "--model", default="gcn", help=f"one or more of {', '.join(MODELS)}, comma-separated"
    )
    parser.add_argument(
        "--style",
        choices=STYLES,
        default="module",
        help="module: nn.ReLU / nn.Dropout modules; example: F.relu / F.elu / F.dropout "
        "in forward, as PyG's examples write models",
    )
    parser.add_argument("--level", default="L3", help=f"one of {', '.join(LEVELS)}")
    parser.add_argument("--get-mem", action="store_true", help="measure retained memory")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--random-projection", type=float, default=None, metavar="FRACTION")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=3000, help="planted-partition size")
    parser.add_argument("--features", type=int, default=128, help="planted-partition features")
    parser.add_argument(
        "--memory-only", action="store_true", help="only measure held memory (no training)"
    )
    parser.add_argument("--data", default=None, help="a torch.save'd torch_geometric Data")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        level_spec(args.level)
    except ValueError as err:
        parser.error(str(err))
    kinds = [k.strip() for k in args.model.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in MODELS]
    if unknown or not kinds:
        parser.error(f"unknown model(s) {unknown}; valid models: {', '.join(MODELS)}")
    if args.epochs < 1 or args.seeds < 1:
        parser.error("--epochs and --seeds must be positive")
    if args.data:
        data = load_data(args.data)
    else:
        data = planted_partition(num_nodes=args.nodes, num_features=args.features)
    results = []
    for kind in kinds:
        result = run(
            kind,
            data,
            level=args.level,
            epochs=args.epochs,
            seeds=() if args.memory_only else range(args.seeds),
            random_projection=args.random_projection,
            get_mem=args.get_mem or args.memory_only,
            hidden=args.hidden,
            device=args.device,
            style=args.style,
        )
        print(format_result(result), end="\n\n" if kind != kinds[-1] else "\n")
        results.append(result)
    if args.json:
        argv = list(sys.argv[1:] if argv is None else argv)
        config = {k: v for k, v in vars(args).items() if k != "json"}
        payload = report.result("act-pyg", [asdict(r) for r in results], config, argv=argv)
        payload["command"] = shlex.join(["python", "-m", "act_pyg.bench", *argv])
        payload["torch_geometric"] = torch_geometric.__version__
        report.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
