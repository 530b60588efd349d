"""actcore.fit_budget over a sweep of budgets: what each plan keeps (ACT's tracker and the
profiler, less the output), how much of the budget it uses, its levels, the blocks it recomputes, and the
planning time. ``--below N``: N more budgets under the smallest the levels alone reach
(10% steps), where the plan recomputes blocks, until none fits.

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
    p.add_argument("--model", default="resnet50", help="a torchvision model, or hf-llama")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224, help="image size, or sequence length")
    p.add_argument("--budgets", type=int, default=12, help="budgets from smallest to exact")
    p.add_argument("--below", type=int, default=0, help="budgets under the levels' smallest")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.model == "hf-llama":  # a 4-layer Llama (width 64) through act_hf, sdpa
        import transformers

        import act_hf

        cfg = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.size,
            attn_implementation="sdpa",
        )
        model = act_hf.convert(transformers.LlamaForCausalLM(cfg), level="L0")
        ids = torch.randint(0, 128, (args.batch, args.size))
        x = {"input_ids": ids, "labels": ids, "use_cache": False}  # training: no KV cache
    else:
        model = getattr(torchvision.models, args.model)(num_classes=1000)
        x = torch.randn(args.batch, 3, args.size, args.size)
    top = actcore.fit_budget(model, x, 2**62)
    rows = []
    span = top.exact_bytes - top.smallest_bytes
    budgets = [
        int(top.smallest_bytes + span * (1 - i / (args.budgets - 1))) for i in range(args.budgets)
    ]
    budgets += [int(top.smallest_bytes * (1 - 0.1 * k)) for k in range(1, args.below + 1)]
    for budget in budgets:
        t0 = time.perf_counter()
        try:
            plan = actcore.fit_budget(model, x, budget)
        except ValueError as e:
            rows.append({"budget": budget, "infeasible": str(e)})
            print(f"{budget:>12} infeasible: {e}")
            break
        seconds = time.perf_counter() - t0
        if isinstance(x, torch.Tensor):
            out, profiled = profiled_bytes(model, x)
        else:
            out, profiled = profiled_bytes(model, **x)
            out = out.logits  # (and a scalar loss)
        output_bytes = out.numel() * out.element_size()
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
                "output_bytes": output_bytes,
                "levels": counts,
                "recompute": list(plan.recompute),
                "plan_seconds": seconds,
            }
        )
        print(
            f"{budget:>12} {plan.kept_bytes:>12} {plan.kept_bytes / budget:6.1%} "
            f"{profiled - output_bytes:>12} {seconds:6.1f}s {counts} recompute {len(plan.recompute)}"
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
