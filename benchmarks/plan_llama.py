"""Memory plans of the Llama 4x512 (sdpa, batch 1) across budgets, each beside checkpointing
alone at the same budget: ``actcore bench plan``'s rows (what each keeps, its step against
plain and against checkpointing alone, timed in turn, its gradient cosine, the predicted
step and error) for a Hugging Face model converted through act_hf; ``--compiled``: torch.compile's
``activation_memory_budget`` at those fractions beside them.

    python benchmarks/plan_llama.py --seq 1024 --order time --json results/x.json --png results/x.png
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from datetime import datetime, timezone

import torch
from llama_memory import build

import act_hf
from actcore import budget as act_budget
from actcore.bench import report
from actcore.bench.plan import COLUMNS, compiled_budgets, plot, sweep_budgets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--budgets", type=int, default=12)
    p.add_argument("--below", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--order", choices=act_budget.ORDERS, default="time")
    p.add_argument(
        "--compiled", default="", help="activation_memory_budget fractions, e.g. 0.2,0.5"
    )
    p.add_argument("--json", required=True)
    p.add_argument("--png", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    plain = build("sdpa").train()
    model = copy.deepcopy(plain)
    act_hf.convert(model, level="L2" if args.order == "time" else "L0")  # the time order's
    ckpt = act_hf.convert(copy.deepcopy(plain), level="L0")  # scope, switched per block
    ids = torch.randint(0, plain.config.vocab_size, (1, args.seq))

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    rows: list[dict] = []
    title = f"memory plans: Llama 4x512, sequence {args.seq}, cpu"
    sweep_budgets(
        model,
        plain,
        ckpt,
        loss,
        rows,
        budgets=args.budgets,
        below=args.below,
        steps=args.steps,
        order=args.order,
        draw=1,
        row={"model": "llama-4x512", "seq": args.seq},
    )
    fractions = tuple(float(f) for f in args.compiled.split(",") if f)
    compiled_budgets(
        plain, loss, rows, fractions, steps=args.steps, draw=1, row={"model": "llama-4x512"}
    )
    report.console().print(report.table(title, COLUMNS, rows))
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/plan_llama.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.png:
        plot(rows, title, args.png)


if __name__ == "__main__":
    main()
