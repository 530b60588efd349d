"""Llama (4 layers, hidden 512, batch 2): bytes kept for backward, gradient cosine and step
time per sequence length, side by side in one run, for plain sdpa, eager attention,
per-layer activation checkpointing, checkpointing + ACT, and ACT at act_hf's default.
``act-logits8`` is an ablation of ACT's loss: the cross-entropy keeps its logits at 8 bits
instead of recomputing them from the LM head's input in backward (what ``act`` does).

Bytes: the CPU profiler's self memory of one training forward (independent of actcore).
Cosine: all parameter gradients against plain sdpa's, second step after conversion.
Time: median of ``--repeats`` forward+backward steps.

    python benchmarks/llama_memory.py --seqs 256,1024,2048,4096 --json benchmarks/results/cpu-llama-memory.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
import warnings
from datetime import datetime, timezone
from unittest import mock

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import act_hf
import actcore.layers.loss
from actcore.memory import profiled_bytes

VARIANTS = ("sdpa", "eager", "ckpt", "ckpt+act", "act", "act-logits8")


def build(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg)


def variant(name: str) -> LlamaForCausalLM:
    model = build("eager" if name == "eager" else "sdpa")
    if name.startswith("ckpt"):
        model.gradient_checkpointing_enable()
    if name in ("act", "ckpt+act", "act-logits8"):
        act_hf.convert(model)
    model.train()
    return model


def step(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[int, torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out, held = profiled_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False))
    out.loss.backward()
    dt = time.perf_counter() - t0
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return held, grads.double(), dt


def timed(model: LlamaForCausalLM, ids: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="256,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help="sdpa is always run first")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = ["sdpa", *(v for v in args.variants.split(",") if v != "sdpa")]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    warnings.filterwarnings("ignore")
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        ids = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(1))
        ref_bytes = ref_grads = None
        for name in names:
            model = variant(name)
            ablation = (
                mock.patch.object(actcore.layers.loss, "linear_source", lambda _logits: None)
                if name == "act-logits8"
                else contextlib.nullcontext()
            )
            with ablation:
                step(model, ids)  # the first step (the loss finds the head)
                held, grads, _ = step(model, ids)
                step_time = timed(model, ids, args.repeats)
            if name == "sdpa":
                ref_bytes, ref_grads = held, grads
            row = {
                "seq": seq,
                "variant": name,
                "mib": held / 2**20,
                "ratio": ref_bytes / held,
                "grad_cosine": F.cosine_similarity(ref_grads, grads, dim=0).item(),
                "step_time_s": step_time,
            }
            rows.append(row)
            print(
                f"seq {seq:5d} {name:11s} {row['mib']:8.1f} MiB  x{row['ratio']:5.2f}  "
                f"cos {row['grad_cosine']:.4f}  {row['step_time_s']:.2f} s",
                flush=True,
            )
            del model
    result = {
        "benchmark": "llama-memory",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": [round(v, 2) for v in os.getloadavg()],
        },
        "torch": torch.__version__,
        "config": {"layers": 4, "hidden": 512, "intermediate": 1376, "batch": 2, "vocab": 1000},
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
