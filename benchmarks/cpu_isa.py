"""The CPU kernels' instruction-set variants against each other, on this machine.

Two parts, each variant the CPU has (``actcore.native.loader.cpu_isa`` caps it):

* kernels: ns an element of quantize, dequantize and the masked ops on a ReLU output
  (4 x 64 x 112 x 112 fp32, 2 bits, group 256), best of 5 runs of 20 calls;
* models: steps of ``speed.py``'s models, plain and the default level, interleaved in one
  process (plain, then the converted model under each of the two best variants), medians
  of the steps that do not collect adaptive statistics, and the profiler's self time of
  the ``actcore::`` kernels in two such steps (a step's difference between variants is a
  few percent: within a shared machine's noise, where the kernels' own time is not);
  ``--compile`` compiles both first.

    python benchmarks/cpu_isa.py --models resnet50 --rounds 12 --json FILE
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date

import speed  # (this folder, the script's own: the models and their step)
import torch

from actcore.native import loader
from actcore.ops import library


def _variants() -> list[str]:
    """The variants this CPU has, lowest first (the kernels loaded)."""
    loader.load_cpu(warn=False)
    best = loader.cpu_isa()
    if best is None:
        raise SystemExit("the CPU kernels did not load: " + str(loader.cpu_status()["error"]))
    return list(loader.CPU_ISAS[: loader.CPU_ISAS.index(best) + 1])


def _ns_per_element(call: Callable[[], object], numel: int) -> float:
    best = float("inf")
    call()
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        best = min(best, (time.perf_counter() - t0) / 20 / numel * 1e9)
    return best


def kernels(variants: list[str]) -> dict[str, dict[str, float]]:
    x = torch.randn(4, 64, 112, 112, generator=torch.Generator().manual_seed(0)).relu()
    shape, n = list(x.shape), x.numel()
    mask = library.relu_mask(x)
    packed = library.quantize(x, 2, 256, True, 5, False)
    masked = library.masked_quantize(x, mask, 2, 256, True, 5)
    calls = {
        "quantize": lambda: library.quantize(x, 2, 256, True, 5, False),
        "dequantize": lambda: library.dequantize(*packed, 2, 256, shape, x.dtype, False),
        "masked_quantize": lambda: library.masked_quantize(x, mask, 2, 256, True, 5),
        "masked_dequantize": lambda: library.masked_dequantize(
            *masked, mask, 2, 256, shape, x.dtype
        ),
    }
    out: dict[str, dict[str, float]] = {}
    for variant in variants:
        loader.cpu_isa(variant)
        out[variant] = {name: _ns_per_element(call, n) for name, call in calls.items()}
    loader.cpu_isa(loader.CPU_ISAS[-1])
    return out


def models(name: str, variants: list[str], rounds: int, compiled: bool) -> dict[str, dict]:
    runs = {}
    for level in ("plain", "L3"):
        model, loss_of = speed.MODELS[name]()
        if level != "plain":
            speed._convert(name, model, level)
        if compiled:
            model.compile()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, loss_of=loss_of, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(model).backward()
            opt.step()

        for _ in range(speed.WARM):
            step()
        runs[level] = (model, step)
    keys = ["plain", *(f"L3@{v}" for v in variants)]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(rounds):
        for key in keys:
            level, _, variant = key.partition("@")
            model, step = runs[level]
            loader.cpu_isa(variant or loader.CPU_ISAS[-1])
            collecting = speed._collecting(model)
            t0 = time.perf_counter()
            step()
            if not collecting:
                times[key].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    rows = {
        key: {
            "steady_step_s": statistics.median(steps),
            "vs_plain": statistics.median(steps) / plain,
            "steps": len(steps),
        }
        for key, steps in times.items()
    }
    model, step = runs["L3"]
    for variant in variants:
        loader.cpu_isa(variant)
        while speed._collecting(model):  # (to a step without adaptive statistics)
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
        kernels_s = {
            e.key: e.self_cpu_time_total / 2e6
            for e in prof.key_averages()
            if e.key.startswith("actcore::")
        }
        rows[f"L3@{variant}"]["actcore_kernels_s_per_step"] = kernels_s
    loader.cpu_isa(loader.CPU_ISAS[-1])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50", help="comma-separated, of speed.py's")
    p.add_argument("--rounds", type=int, default=12, help="interleaved steps per variant")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--compile", action="store_true", help="both models compiled")
    p.add_argument("--no-models", action="store_true", help="the kernels only")
    p.add_argument("--json", default=None, help="write the results (and the machine) here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    variants = _variants()
    result: dict = {"kernels_ns_per_element": kernels(variants), "models": {}}
    for variant, row in result["kernels_ns_per_element"].items():
        print(f"{variant:9s} " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    for name in [] if args.no_models else args.models.split(","):
        rows = models(name, variants[-2:], args.rounds, args.compile)
        result["models"][name + ("@compiled" if args.compile else "")] = rows
        for key, row in rows.items():
            own = sum(row.get("actcore_kernels_s_per_step", {}).values())
            print(
                f"{name:12s} {key:12s} {row['steady_step_s'] * 1e3:8.1f} ms "
                f"({row['vs_plain']:.2f}x plain)"
                + (f", actcore kernels {own * 1e3:.1f} ms" if own else ""),
                flush=True,
            )
    if args.json:
        result["meta"] = {
            "date": date.today().isoformat(),
            "machine": speed._cpu_name(),
            "threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "variants": variants,
            "command": " ".join(["python", *sys.argv]),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
