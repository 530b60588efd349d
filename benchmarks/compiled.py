"""ACT inside torch.compile, side by side in one run per model: eager plain, compiled plain,
compiled plain with PyTorch's float8 activation pass, compiled plain with
``activation_memory_budget=0.5``, eager ACT (``compress_saved_tensors``), compiled ACT (the
same context around the compiled model: its pack and unpack inlined into the graphs) and
compiled ACT under the same budget (what the partitioner keeps, ACT packs); with
``--route convert``, ACT is ``actcore.convert(model, level)`` (eager, and compiled into one
graph).

Held: bytes one training forward leaves allocated for backward (CPU: the profiler's self
memory, independent of actcore; CUDA: ``memory_allocated`` after the forward minus before).
Cosine: all parameter gradients of one step against eager plain's. Time: median of
``--repeats`` forward+backward steps after two warm-up steps (the compilation).

    python benchmarks/compiled.py --models gpt,llama,resnet50,vit_b_16 --json benchmarks/results/cpu-compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.bench.report import machine_info
from actcore.bench.zoo import compile_settings
from actcore.memory import profiled_bytes

VARIANTS = (
    "eager",
    "compiled",
    "compiled+float8",
    "compiled+budget0.5",
    "eager-act",
    "compiled-act",
    "compiled-act+budget0.5",
)


class GPT(nn.Module):
    """nanoGPT's shape: pre-norm blocks of causal sdpa and a GELU MLP, tied-free head."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 4, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(1024, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "qkv": nn.Linear(d, 3 * d),
                    "proj": nn.Linear(d, d),
                    "ln2": nn.LayerNorm(d),
                    "fc": nn.Linear(d, 4 * d),
                    "out": nn.Linear(4 * d, d),
                }
            )
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.emb(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(x.shape[-1], -1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x))))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(name: str, device: torch.device) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    """The model and a function of it that returns one training loss."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT()
        idx = torch.randint(0, 256, (8, 256), device=device)
        return model.to(device), lambda m: m(idx, idx)
    if name == "llama":
        from llama_memory import build as build_llama  # the Llama 4x512 of BENCHMARKS.md

        model = build_llama("sdpa")
        ids = torch.randint(0, 1000, (1, 1024), device=device)
        return model.to(device), lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50()
        x = torch.randn(4, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (4,), device=device)
        return model.to(device), lambda m: F.cross_entropy(m(x), y)
    if name == "vit_b_16":
        import torchvision

        model = torchvision.models.vit_b_16()
        # (torchvision starts the head at zero: no gradient would reach the encoder)
        nn.init.normal_(model.heads.head.weight, std=0.02)
        x = torch.randn(2, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (2,), device=device)
        return model.to(device), lambda m: F.cross_entropy(m(x), y)
    raise SystemExit(f"unknown model {name!r}; choose from gpt, llama, resnet50, vit_b_16")


def compile_config(variant: str) -> Any:
    """The inductor / partitioner settings of ``variant`` while it compiles and runs."""
    if variant == "compiled+float8":
        return compile_settings("float8")
    if variant.endswith("+budget0.5"):
        return compile_settings("budget", 0.5)
    return compile_settings(None)


def measure(
    name: str, variant: str, level: str, device: torch.device, repeats: int, route: str = "hooks"
) -> dict:
    model, loss_of = build(name, device)
    model.train()
    act = "-act" in variant
    if act and route == "convert":  # the layer route: Q-layers and the model's scope
        model = actcore.convert(model, level)
    runner: Any = torch.compile(model) if variant.startswith("compiled") else model
    hooks = act and route == "hooks"

    def forward() -> torch.Tensor:
        ctx = actcore.compress_saved_tensors(level) if hooks else contextlib.nullcontext()
        with ctx:
            return loss_of(runner)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    row: dict[str, Any] = {
        "model": name,
        "variant": variant,
        "level": level if act else None,
        "route": route if act else None,
    }
    torch._dynamo.reset()
    with compile_config(variant):
        t0 = time.perf_counter()
        for _ in range(2):  # compiles forward and backward
            model.zero_grad(set_to_none=True)
            forward().backward()
        sync()
        row["warmup_s"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if device.type == "cuda":
            sync()
            before = torch.cuda.memory_allocated(device)
            loss = forward()
            sync()
            row["held_bytes"] = torch.cuda.memory_allocated(device) - before
        else:
            loss, row["held_bytes"] = profiled_bytes(forward)
        loss.backward()
        row["grads"] = torch.cat([p.grad.flatten().double() for p in model.parameters()])
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            forward().backward()
            sync()
            times.append(time.perf_counter() - t0)
        row["step_s"] = statistics.median(times)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama,resnet50")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--route",
        choices=("hooks", "convert"),
        default="hooks",
        help="ACT variants through compress_saved_tensors (hooks) or actcore.convert",
    )
    p.add_argument(
        "--level", default=None, help="the ACT variants' level (default: G1.2 hooks, L3 convert)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows (and machine, torch, date) here")
    args = p.parse_args()
    args.level = args.level or ("G1.2" if args.route == "hooks" else "L3")
    device = torch.device(args.device)
    rows = []
    for name in args.models.split(","):
        base: dict[str, Any] = {}
        for variant in args.variants.split(","):
            try:
                row = measure(name, variant, args.level, device, args.repeats, args.route)
            except Exception as e:  # one variant failing leaves the others' rows
                row = {"model": name, "variant": variant, "error": f"{type(e).__name__}: {e}"}
                print(f"{name:9s} {variant:20s} ERROR {row['error'][:200]}", flush=True)
                rows.append(row)
                continue
            grads = row.pop("grads")
            base.setdefault("grads", grads)
            base.setdefault("held", row["held_bytes"])
            base.setdefault("step", row["step_s"])
            cos = F.cosine_similarity(grads, base["grads"], 0).item()
            row.update(
                grad_cosine=cos,
                held_ratio_eager=base["held"] / max(row["held_bytes"], 1),
                step_vs_eager=row["step_s"] / base["step"],
            )
            rows.append(row)
            print(
                f"{name:9s} {variant:20s} held {row['held_bytes'] / 2**20:8.2f} MiB "
                f"(x{row['held_ratio_eager']:5.2f})  step {row['step_s'] * 1e3:8.1f} ms "
                f"(x{row['step_vs_eager']:5.2f})  cos {cos:.4f}  warm-up {row['warmup_s']:.0f} s",
                flush=True,
            )
            if args.json:
                _write(args, rows)
    if args.json:
        _write(args, rows)


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    data = {
        "benchmark": "compiled",
        "machine": machine_info(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/compiled.py "
        f"--models {args.models} --variants {args.variants} --route {args.route} "
        f"--level {args.level} "
        f"--repeats {args.repeats}",
        "rows": rows,
    }
    with open(args.json, "w") as fh:
        json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
