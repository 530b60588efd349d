"""actcore.fit_budget over a sweep of budgets: what each plan keeps (ACT's tracker and the
profiler), how much of the budget it uses, its levels, and the planning time.

    python benchmarks/fit_budget.py --model resnet50 --batch 8 --size 224 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import torch
import torchvision

import actcore
from actcore.memory import profiled_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--budgets", type=int, default=12, help="budgets from smallest to exact")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=1000)
    x = torch.randn(args.batch, 3, args.size, args.size)
    top = actcore.fit_budget(model, x, 2**62)
    rows = []
    span = top.exact_bytes - top.smallest_bytes
    for i in range(args.budgets):
        budget = int(top.smallest_bytes + span * (1 - i / (args.budgets - 1)))
        t0 = time.perf_counter()
        plan = actcore.fit_budget(model, x, budget)
        seconds = time.perf_counter() - t0
        out, profiled = profiled_bytes(model, x)
        del out
        counts: dict[str, int] = {}
        for level in plan.levels.values():
            counts[level] = counts.get(level, 0) + 1
        rows.append(
            {
                "budget": budget,
                "kept_bytes": plan.kept_bytes,
                "used": plan.kept_bytes / budget,
                "profiled_bytes": profiled,
                "levels": counts,
                "plan_seconds": seconds,
            }
        )
        print(
            f"{budget:>12} {plan.kept_bytes:>12} {plan.kept_bytes / budget:6.1%} "
            f"{profiled:>12} {seconds:6.1f}s {counts}"
        )
    result = {
        "benchmark": "fit_budget",
        "model": args.model,
        "batch": args.batch,
        "image_size": args.size,
        "exact_bytes": top.exact_bytes,
        "smallest_bytes": top.smallest_bytes,
        "rows": rows,
        "date": date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
