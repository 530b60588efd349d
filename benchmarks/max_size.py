"""The largest batch (ResNet-50) or sequence (Llama 4x512, sdpa) a budget of bytes kept
for backward allows, three ways: plain PyTorch (every layer exact, nothing recomputed),
checkpointing alone (blocks recomputed, nothing compressed) and ACT (compression, the scope
and recompute), each found by ``actcore.max_batch`` / ``max_seq``. Each size is checked
twice: its plan's forward, measured by the profiler (independent of ACT's tracker; for
plain, the unconverted model's), keeps at most the budget, and ``actcore.fit_budget`` refuses the next size at the same levels.

ACT's route: the model converted at L2 (the scope packs what no Q-layer saves) and planned
over L2/L3 with recompute by the bytes order; the size a budget allows is what the least
plan keeps, the same for every order (the order shapes only the plan at that size).

    python benchmarks/max_size.py --model resnet50 --budget 512MiB --json results/x.json
    python benchmarks/max_size.py --model llama --budget 64MiB --json results/y.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

import actcore
from actcore.bench import report
from actcore.memory import format_bytes, profiled_bytes

ROUTES = {  # route -> (levels, recompute)
    "plain": (("L0",), False),
    "checkpointing": (("L0",), True),
    "act": (("L2", "L3"), True),
}


def resnet50(image_size: int) -> tuple[nn.Module, Callable[[int], Any], Callable[..., Any]]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000)

    def inputs(batch: int) -> torch.Tensor:
        return torch.randn(
            batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(0)
        )

    return model, inputs, actcore.convert


def llama() -> tuple[nn.Module, Callable[[int], Any], Callable[..., Any]]:
    from llama_memory import build

    import act_hf

    model = build("sdpa").train()

    def inputs(seq: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, inputs, act_hf.convert


def kept_by_profiler(model: nn.Module, inputs: Any) -> int:
    """What one forward leaves allocated (the profiler's self memory), less its output."""
    torch.manual_seed(0)
    call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(inputs))
    out, held = profiled_bytes(call)
    outputs = [v for v in (out.values() if isinstance(out, dict) else [out])]
    return held - sum(t.numel() * t.element_size() for t in outputs if torch.is_tensor(t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("resnet50", "llama"), default="resnet50")
    p.add_argument("--budget", default="512MiB")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--multiple-of", type=int, default=None, help="default 1, or 16 (Llama)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if args.model == "resnet50":
        base, inputs, convert = resnet50(args.image_size)
        search, what = actcore.max_batch, "batch"
    else:
        base, inputs, convert = llama()
        search, what = actcore.max_seq, "sequence"
    multiple = args.multiple_of or (16 if args.model == "llama" else 1)
    budget = actcore.budget.parse_bytes(args.budget)
    rows: list[dict[str, Any]] = []
    for route, (levels, recompute) in ROUTES.items():
        model = convert(copy.deepcopy(base), level=levels[0])
        t0 = time.perf_counter()
        size, plan = search(
            model,
            inputs,
            budget,
            levels=levels,
            recompute=recompute,
            multiple_of=multiple,
            order="bytes",
        )
        seconds = time.perf_counter() - t0
        profiled = kept_by_profiler(base if route == "plain" else model, inputs(size))
        try:  # the next size, at the same levels: refused
            actcore.fit_budget(
                model,
                inputs(size + multiple),
                budget,
                levels=levels,
                recompute=recompute,
                order="bytes",
            )
            refused = ""
        except ValueError as e:
            refused = str(e)
        rows.append(
            {
                "route": route,
                what: size,
                "kept_bytes": plan.kept_bytes,
                "profiled_bytes": profiled,
                "recomputed": len(plan.recompute),
                "levels": sorted(set(plan.levels.values())),
                "next_refused": bool(refused),
                "next_reason": refused,
                "search_seconds": seconds,
            }
        )
        print(
            f"{route}: {what} {size}, keeps {format_bytes(plan.kept_bytes)} "
            f"(profiler {format_bytes(profiled)}), next refused: {bool(refused)}, "
            f"{seconds:.0f} s",
            flush=True,
        )
    plain, ckpt = rows[0][what], rows[1][what]
    for r in rows:
        r["vs_plain"] = r[what] / plain
        r["vs_checkpointing"] = r[what] / ckpt
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "budget_bytes": budget,
        "command": "python benchmarks/max_size.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and not (k == "image_size" and args.model == "llama")
        ),
        "machine_info": report.machine_info(),
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(
            f"{r['route']:>14}: {what} {r[what]:>6}  {r['vs_plain']:.2f}x plain  "
            f"{r['vs_checkpointing']:.2f}x checkpointing"
        )


if __name__ == "__main__":
    main()
