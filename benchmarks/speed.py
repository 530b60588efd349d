"""Step time of converted models against plain PyTorch, paired in one process (the speed issue).

    python benchmarks/speed.py --json benchmarks/results/cpu-speed-<date>.json
    python benchmarks/speed.py --models mobilenet_v3_small --rounds 3

For each model every variant (plain, L0, the default level; for ResNet-50 also the
saved-tensor hooks route at its default level, ``Controller(model, "G2")``) is built once, warmed past the
adaptive plan's first replan, then stepped in interleaved rounds (one step of each variant
per round, so machine load falls on all alike). Reported per variant: the median step over
the steady steps (no statistics taken), the mean over all measured steps (the adaptive
window's statistics steps included, 4 in every 20), the first step (the hooks route's
includes its first sensitivity estimate), and the ATen calls of one steady step
and of one statistics step (torch.profiler count). Models and sizes are the issue's, each
converted through its own entry point: ResNet-50 batch 4 at 224x224, mobilenet_v3_small and
efficientnet_b0 batch 4 at 64x64, the character GPT of ``actcore bench train`` (4 layers,
width 128, batch 12 x 64 tokens; ``actcore.convert``); the Llama of
``benchmarks/llama_memory.py`` (4 layers, hidden 512, sdpa, loss from ``labels``) at batch 1,
sequence 2048 (``act_hf.convert``, needs transformers); PyG's example GCN on a 10,000-node
graph and example GIN on 256 graphs of 20 nodes (``act_pyg.convert``, needs
torch_geometric). SGD, so an optimizer's own cost is left out.

With ``--compile`` the variants are plain and the default level, eager and compiled
(``model.compile()`` after conversion, inductor), interleaved the same way; compiled rows
also give their step against the compiled plain model's. ``llama-1024`` is the Llama at
sequence 1024 (the compile issue's size):

    python benchmarks/speed.py --compile --models resnet50,llama-1024 --rounds 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import date

import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.bench.calls import count_calls
from actcore.bench.gpt import CharGPT, GPTConfig

VARIANTS = ("plain", "L0", "L3")
HOOKS = "G2"  # the saved-tensor hooks route at its default level (ResNet-50 only)
COMPILED = "@compiled"  # (--compile: the variant compiled with model.compile())
WARM = 21  # past the first replan (interval 20)


def _vision(name: str, batch: int, size: int) -> Callable[[], tuple[nn.Module, Callable]]:
    def build() -> tuple[nn.Module, Callable]:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10)
        x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
        return model, lambda m: F.cross_entropy(m(x), y)

    return build


def _gpt() -> tuple[nn.Module, Callable]:
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(vocab_size=65))
    ids = torch.randint(0, 65, (12, 65))
    return model, lambda m: m(ids[:, :-1], ids[:, 1:])


def _llama(sequence: int = 2048) -> Callable[[], tuple[nn.Module, Callable]]:
    def build_it() -> tuple[nn.Module, Callable]:
        from llama_memory import build  # (this folder: the Llama of the memory benchmark)

        model = build("sdpa").train()  # (seeded there)
        ids = torch.randint(0, 1000, (1, sequence))
        return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss

    return build_it


def _gcn() -> tuple[nn.Module, Callable]:
    """PyG's example GCN (functional dropout and relu) on a 10,000-node graph, full batch."""
    from act_pyg.bench_data import planted_partition
    from act_pyg.bench_models import ExampleGCN

    data = planted_partition(num_nodes=10_000, num_classes=8, num_features=128, seed=0)
    torch.manual_seed(0)
    model = ExampleGCN(128, 64, 8)
    return model, lambda m: F.cross_entropy(m(data.x, data.edge_index), data.y)


def _gin() -> tuple[nn.Module, Callable]:
    """PyG's example GIN (convs holding ``MLP``, ``F.relu``) on a batch of 256 graphs of 20
    nodes, classified by their summed node outputs."""
    from torch_geometric.nn import global_add_pool

    from act_pyg.bench_models import ExampleGIN

    gen = torch.Generator().manual_seed(0)
    graphs, nodes, degree = 256, 20, 4
    src = torch.randint(0, nodes, (graphs, nodes * degree), generator=gen)
    dst = torch.randint(0, nodes, (graphs, nodes * degree), generator=gen)
    offset = (torch.arange(graphs) * nodes)[:, None]
    edge_index = torch.stack([(src + offset).flatten(), (dst + offset).flatten()])
    x = torch.randn(graphs * nodes, 32, generator=gen)
    batch = torch.arange(graphs).repeat_interleave(nodes)
    y = torch.randint(0, 2, (graphs,), generator=gen)
    torch.manual_seed(0)
    model = ExampleGIN(32, 64, 2)
    return model, lambda m: F.cross_entropy(
        global_add_pool(m(x, edge_index), batch, size=graphs), y
    )


MODELS: dict[str, Callable[[], tuple[nn.Module, Callable]]] = {
    "resnet50": _vision("resnet50", 4, 224),
    "mobilenet_v3_small": _vision("mobilenet_v3_small", 4, 64),
    "efficientnet_b0": _vision("efficientnet_b0", 4, 64),
    "char_gpt": _gpt,
    "llama": _llama(2048),
    "llama-1024": _llama(1024),  # (the compile issue's size)
    "gcn": _gcn,
    "gin": _gin,
}


def _convert(name: str, model: nn.Module, level: str) -> None:
    """The model's own entry point: act_hf for the Hugging Face decoder, act_pyg for the
    graph networks, else actcore."""
    if name.startswith("llama"):
        import act_hf

        act_hf.convert(model, level)
    elif name in ("gcn", "gin"):
        import act_pyg

        act_pyg.convert(model, level)
    else:
        actcore.convert(model, level=level)


@contextlib.contextmanager
def _hooked(controller: actcore.Controller) -> Iterator[None]:
    controller.install_hook()
    try:
        yield
    finally:
        controller.uninstall_hook()


def _collecting(model: nn.Module) -> bool:
    """Whether the model's next step takes adaptive statistics (a compiled model's never
    does: its graphs pack with the level's bits by kind)."""
    if getattr(model, "_compiled_call_impl", None) is not None:  # (model.compile())
        return False
    scheme = getattr(model, "act_adaptive", None)
    return scheme is not None and scheme.collecting()


def _count(model: nn.Module, step: Callable[[], None], collecting: bool) -> int:
    """ATen calls of the next step that does (or does not) take statistics."""
    for _ in range(2 * WARM):
        if _collecting(model) == collecting:
            return count_calls(step)[0]
        step()
    raise RuntimeError(f"no {'statistics' if collecting else 'steady'} step in {2 * WARM}")


def measure(name: str, rounds: int, compiled: bool = False) -> list[dict]:
    """``name``'s rows; with ``compiled`` the variants are plain, the default level, and
    both compiled (``model.compile()`` after conversion), each step of them interleaved."""
    runs, first = {}, {}
    if compiled:
        variants: tuple[str, ...] = ("plain", "L3", *(f"{v}{COMPILED}" for v in ("plain", "L3")))
    else:
        variants = (*VARIANTS, HOOKS) if name == "resnet50" else VARIANTS
    for variant in variants:
        model, loss_of = MODELS[name]()
        controller = None
        level = variant.removesuffix(COMPILED)
        if variant == HOOKS:
            controller = actcore.Controller(model, HOOKS)
        elif level != "plain":
            _convert(name, model, level)
        if variant.endswith(COMPILED):
            model.compile()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, loss_of=loss_of, opt=opt, controller=controller) -> None:
            # the hooks route's hooks are process-wide: on only for its own steps here
            hooked = contextlib.nullcontext() if controller is None else _hooked(controller)
            with hooked:
                opt.zero_grad(set_to_none=True)
                loss_of(model).backward()
                opt.step()
                if controller is not None:  # (its adaptive policy re-estimates now and then)
                    controller.iterate(lambda: loss_of(model).backward())

        t0 = time.perf_counter()
        step()  # (the hooks route's first step estimates its sensitivities, a compiled
        # model compiles: timed apart)
        first[variant] = time.perf_counter() - t0
        for _ in range(WARM - 1):
            step()
        runs[variant] = (model, step, [], [])
    for _ in range(rounds):
        for _variant, (model, step, steady, window) in runs.items():
            collecting = _collecting(model)
            t0 = time.perf_counter()
            step()
            (window if collecting else steady).append(time.perf_counter() - t0)
    rows = []
    for variant, (model, step, steady, window) in runs.items():
        calls = {"steady": _count(model, step, collecting=False)}
        if getattr(model, "act_adaptive", None) is not None and not variant.endswith(COMPILED):
            calls["window"] = _count(model, step, collecting=True)
        every = steady + window
        rows.append(
            {
                "model": name,
                "variant": variant,
                "first_step_s": first[variant],
                "steady_step_s": statistics.median(steady),
                "mean_step_s": statistics.fmean(every),
                "steps": {"steady": len(steady), "window": len(window)},
                "aten_calls": calls,
            }
        )
    plain = rows[0]
    by_variant = {row["variant"]: row for row in rows}
    for row in rows:
        if row["variant"].endswith(COMPILED):  # (against the compiled plain model)
            compiled_plain = by_variant["plain" + COMPILED]
            row["steady_vs_compiled_plain"] = row["steady_step_s"] / compiled_plain["steady_step_s"]
        row["steady_vs_plain"] = row["steady_step_s"] / plain["steady_step_s"]
        row["mean_vs_plain"] = row["mean_step_s"] / plain["mean_step_s"]
        row["calls_vs_plain"] = row["aten_calls"]["steady"] / plain["aten_calls"]["steady"]
    return rows


def _cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    p.add_argument("--rounds", type=int, default=20, help="interleaved measured steps per variant")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json", default=None, help="write the rows (and the machine) here")
    p.add_argument(
        "--compile",
        action="store_true",
        help="plain and L3, eager and compiled (model.compile() after conversion), interleaved",
    )
    args = p.parse_args()
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        for row in measure(name, args.rounds, args.compile):
            rows.append(row)
            calls = row["aten_calls"]
            versus = row.get("steady_vs_compiled_plain")
            print(
                f"{name:20s} {row['variant']:14s} "
                + ("" if versus is None else f"vs compiled plain {versus:.2f}x  ")
                + f"steady {row['steady_step_s'] * 1e3:8.1f} ms "
                f"({row['steady_vs_plain']:.2f}x)  mean {row['mean_step_s'] * 1e3:8.1f} ms "
                f"({row['mean_vs_plain']:.2f}x)  first {row['first_step_s']:.2f} s  ATen calls {calls}",
                flush=True,
            )
    if args.json:
        from actcore.native import loader

        loader.load_cpu(warn=False)
        meta = {
            "date": date.today().isoformat(),
            "machine": _cpu_name(),
            "threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_kernel_threads": loader.cpu_status().get("threads"),
            "cpu_kernel_isa": loader.cpu_isa(),
            "command": " ".join(["python", *sys.argv]),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
