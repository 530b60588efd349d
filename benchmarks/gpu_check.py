"""The GPU check: one command that proves the CUDA side of actcore in one short run.

Each part runs in its own process under its own time cap (and all of them under
``--budget``), and the merged results are rewritten after every part, so a part that
hangs or runs out of time still leaves the earlier ones::

    python3 benchmarks/gpu_check.py --out DIR            # on a CUDA machine (make gpu-check)
    python3 benchmarks/gpu_check.py --out DIR --dry-run  # CPU, tiny sizes (CI)

Parts, in order: ``env`` (device, driver, torch), ``build`` (the native kernels with
ninja), ``tests`` (the GPU-marked tests: bit-exactness, opcheck), ``sync`` (host syncs of
a steady L3 step, under ``torch.cuda.set_sync_debug_mode``), ``kernels`` (quantize and
dequantize as a share of copy bandwidth), ``ncu`` (Nsight Compute on those kernels, where
installed), ``resnet`` (ResNet-50, bf16 autocast: step time
and peak memory for plain, checkpointing, L2, L3, L3 with its zero-value counts read back
(the sizing before 2026-11-27, paired), L4 = L3 + swap), ``llama`` (Llama 4x512,
bf16 autocast: memory kept for backward and step time for sdpa, checkpointing, ACT,
checkpointing + ACT), ``profile`` (host against kernel time of an L3 step, top ops),
``plan-time`` (the fastest plan that fits, ``order="time"``, on the Llama at 40/20/10% of
its exact bytes beside checkpointing alone: bytes held against the budget, peak, tokens/s),
``peak-trace`` (where a batch-512 step peaks), ``max-batch-*`` (ResNet-50's largest batch,
plain, checkpointing, L3), ``budget`` (fit_budget's plans on a step's peak and max_batch at the
default budget, against what a step allocates), ``compiled`` (ResNet-50 under
``torch.compile``, bf16 autocast: compiled plain against compiled L3, step time, bytes kept,
gradient cosine). Output: ``DIR/gpu-check.json`` and ``DIR/gpu-check.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = [
    "packages/actcore/tests/test_native.py",
    "packages/actcore/tests/test_swap.py",
    "packages/actcore/tests/test_memory.py",
    "packages/actcore/tests/test_host_syncs.py::test_cuda_steady_step_does_not_synchronise",
]
# (part, cap in seconds on a GPU); the dry run caps every part at 300 s.
PARTS: list[tuple[str, int]] = [
    ("env", 30),
    ("build", 180),
    ("tests", 180),
    ("sync", 45),
    ("kernels", 45),
    ("ncu", 120),
    ("resnet", 100),
    ("llama", 90),
    ("plan-time", 150),
    ("profile", 60),
    ("peak-trace", 60),
    ("max-batch-fp", 40),
    ("max-batch-ckpt", 40),
    ("max-batch-L3", 60),
    ("budget", 240),
    ("compiled", 300),
]


# ---------------------------------------------------------------------------- helpers
def _device(dry: bool) -> Any:
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("the GPU check needs a CUDA device (use --dry-run on a CPU)")
    return torch.device("cuda")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: Any) -> Any:
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16)


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _median_time(step: Callable[[], None], device: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


INTERVAL = 20
"""Adaptive bits' default replan interval: its statistics are taken every step before the
first replan, then over the last 4 of each 20; the steady step time is the mean over one
whole interval after the first replan."""


def _interval_time(step: Callable[[], None], device: Any, done: int, steps: int) -> float:
    """Mean step time over ``steps`` steps once ``done`` steps (warm-up) reach INTERVAL."""
    for _ in range(max(0, INTERVAL - done)):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _peak(step: Callable[[], None], device: Any) -> dict[str, int | None]:
    """Peak bytes allocated during ``step`` above what was allocated before it."""
    import torch

    if device.type != "cuda":
        step()
        return {"peak_bytes": None, "peak_above_start_bytes": None}
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {
        "peak_bytes": peak,
        "peak_above_start_bytes": peak - start,
        "reserved_peak_above_start_bytes": torch.cuda.max_memory_reserved(device) - reserved,
    }


def _held(model: Any, x: Any, device: Any) -> int | None:
    """Bytes a training forward leaves allocated for backward (gradients set to None)."""
    import torch

    if device.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    with _autocast(device):
        out = model(x)
    _sync(device)
    held = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()
    out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return held


def _classifier_step(model: Any, x: Any, y: Any, device: Any) -> Callable[[], None]:
    """One forward + backward of a classifier under bf16 autocast (no optimizer)."""
    import torch

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()

    return step


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- parts
def part_env(dry: bool, out: Path) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["driver"] = smi.stdout.strip() or None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        info["commit"] = rev.stdout.strip() or None
    return info


def part_build(dry: bool, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "actcore.native", "status" if dry else "build"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    result = {
        "command": " ".join(cmd[1:]),
        "seconds": time.perf_counter() - t0,
        "returncode": done.returncode,
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }
    if done.returncode:
        raise RuntimeError(f"{result['command']} failed:\n{result['output_tail']}")
    return result


def _crashed_test(output: str) -> str | None:
    """The test ``pytest -v`` had started when the process died (its last unfinished line)."""
    started = [ln.split()[0] for ln in output.splitlines() if "::" in ln and ln.split()]
    return started[-1] if started else None


def part_tests(dry: bool, out: Path) -> dict[str, Any]:
    """The CUDA tests. A test that crashes the process (a segfault) is recorded as
    ``crashed`` and the run goes on without it, so one crash hides no other result."""
    import xml.etree.ElementTree as ET

    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    failed: list[str] = []
    crashed: list[str] = []
    returncodes: list[int] = []
    output = ""
    for attempt in range(4):
        xml = out / f"tests-{attempt}.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir=."]
        cmd += TEST_FILES  # (node ids relative to the checkout, as -v prints them)
        cmd += ["-k", "not compile_check", f"--junitxml={xml}"]
        cmd += [f"--deselect={test}" for test in crashed]
        if dry:
            cmd.append("--collect-only")
        # stderr too: a crash's faulthandler traceback names the test and the line
        done = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
        )
        returncodes.append(done.returncode)
        output = done.stdout
        crash = _crashed_test(output) if done.returncode < 0 else None
        if crash is None or crash in crashed:
            break
        crashed.append(crash)  # killed by a signal: again, without the test it was in
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in counts}
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                msg = (bad.get("message") or "")[:300]
                failed.append(f"{case.get('classname')}::{case.get('name')}: {msg}")
    return {
        "returncodes": returncodes,
        "part_ok": returncodes[-1] == 0 and not crashed,  # a crash or a failure fails it
        "crashed": crashed,
        "counts": counts,
        "failed": failed,
        "output_tail": output[-6000:],
    }


def part_sync(dry: bool, out: Path) -> dict[str, Any]:
    """Host syncs of one steady step of ResNet-18, plain and at L3 (warmed past the first
    replan of adaptive bits, on a step that neither replans nor collects statistics), each
    counted by site: the last actcore frame, or the last three frames outside it."""
    import torch
    import torchvision

    import actcore

    device = _device(dry)
    size, batch = (32, 2) if dry else (112, 32)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    result: dict[str, Any] = {}
    for name, level in (("fp", None), ("L3", "L3")):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        if level is not None:
            model = actcore.convert(model, level=level)
        step = _classifier_step(model.to(device), x, y, device)
        for _ in range(1 if dry else INTERVAL + 1):
            step()
        _sync(device)
        if device.type != "cuda":
            step()
            result[name] = {"syncs": None, "note": "CPU dry run: syncs are counted on CUDA"}
            continue
        result[name] = _count_syncs(step)
    if device.type == "cuda":
        from actcore.compressors import zero_value

        _sync(device)
        result["zero_value_left_unsettled"] = zero_value.settle()
    result["syncs"] = (result["L3"] or {}).get("syncs")
    return result


def _count_syncs(step: Callable[[], None]) -> dict[str, Any]:
    import torch

    sites: dict[str, int] = {}
    total = 0

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        nonlocal total
        if "synchroniz" not in str(message):
            return
        total += 1
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "actcore" in f.filename]
        if ours:
            key = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}"
        else:
            key = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-3:])
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {"syncs": total, "sites": sites}


def part_kernels(dry: bool, out: Path) -> dict[str, Any]:
    from actcore.bench import kernels

    device = _device(dry)
    if device.type != "cuda":
        return {"note": "CPU dry run: kernels time CUDA events only", "rows": []}
    rows: list[dict[str, Any]] = []
    for dtype in ("fp32", "bf16"):
        cfg = kernels.KernelConfig(sizes=[1 << 24, 1 << 26], dtype=dtype, iters=10)
        kernels.run(cfg, rows)
        _write(out / "part-kernels.partial.json", rows)
    worst = min(r["pct_of_copy"] for r in rows if r["op"] != "copy")
    return {"rows": rows, "worst_pct_of_copy": worst}


NCU_SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
)
NCU_KERNELS = "regex:quantize_kernel|dequantize_kernel"
NCU_PIPES = ",".join(
    (
        r"regex:sm__inst_executed_pipe_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active",
        r"regex:smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio",
        "smsp__inst_executed.sum",
        "sm__cycles_elapsed.avg",
    )
)
_NCU_SCRIPT = """
import torch
from actcore import ops
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(1 << 18, 256, device="cuda", dtype=dtype)
    p = ops.quantize(x, 2, group_size=256, seed=0)
    ops.dequantize(p)
    torch.cuda.synchronize()
"""


def part_ncu(dry: bool, out: Path) -> dict[str, Any]:
    """Nsight Compute on the quantize and dequantize kernels (fp32 and bf16, 64 Mi elements,
    2 bits): throughput against the memory and compute roofs, occupancy, why warps stall.
    Skipped (with the reason) where ``ncu`` or a GPU is missing."""
    import csv
    import io
    import shutil

    tool = shutil.which("ncu") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu")) if p.is_file()), None
    )
    if dry or tool is None:
        return {"note": "skipped: " + ("CPU dry run" if dry else "no ncu on this machine")}
    cmd = [tool, "--csv", "--kernel-name", NCU_KERNELS, "--launch-count", "4"]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, "-c", _NCU_SCRIPT]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=110)
    text = done.stdout
    header = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[header:]))) if header >= 0 else []
    kernels: dict[str, dict[str, str]] = {}
    for row in rows:
        key = f"{row.get('ID')} {row.get('Kernel Name', '')[:60]}"
        unit = row.get("Metric Unit") or ""
        kernels.setdefault(key, {})[row.get("Metric Name", "?")] = (
            f"{row.get('Metric Value')} {unit}".strip()
        )
    # where the cycles go: each pipe's share of its peak, and the stall reasons per issue
    pipes = subprocess.run(
        [
            *cmd[:6],
            "--metrics",
            NCU_PIPES,
            sys.executable,
            "-c",
            _NCU_SCRIPT,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=110,
    )
    head = pipes.stdout.find('"ID"')
    for row in csv.DictReader(io.StringIO(pipes.stdout[head:])) if head >= 0 else []:
        key = f"{row.get('ID')} {row.get('Kernel Name', '')[:60]}"
        value = row.get("Metric Value")
        if value not in (None, "", "0", "0.00"):
            kernels.setdefault(key, {})[row.get("Metric Name", "?")] = value
    return {
        "returncode": done.returncode,
        "pipes_returncode": pipes.returncode,
        "pipes_tail": pipes.stderr[-800:],
        "kernels": kernels,
        "output_tail": (done.stdout[-1500:] if not kernels else "") + done.stderr[-1500:],
        "part_ok": done.returncode == 0 and bool(kernels),
    }


def _resnet(variant: str, device: Any, dry: bool) -> Any:
    import torch
    import torchvision

    import actcore
    from actcore.bench.zoo import checkpoint_blocks

    torch.manual_seed(0)
    model = torchvision.models.resnet18() if dry else torchvision.models.resnet50()
    if variant == "ckpt":
        checkpoint_blocks(model)
    elif variant != "fp":
        actcore.convert(model, level=variant)
    return model.to(device).train()


def part_resnet(dry: bool, out: Path) -> dict[str, Any]:
    import torch

    device = _device(dry)
    batch, size, repeats = (2, 32, 1) if dry else (64, 224, 5)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    rows = []
    for variant in ("fp", "ckpt", "L2", "L3", "L3-readback", "L4"):
        with _zero_value_readback(variant.endswith("-readback")):
            _resnet_row(variant, device, dry, x, y, batch, size, repeats, rows)
        _write(out / "part-resnet.partial.json", rows)
        _free(device)
    fp = rows[0]
    for row in rows:
        row["step_vs_fp"] = row["step_time_s"] / fp["step_time_s"]
        row["interval_step_vs_fp"] = row["step_time_interval_s"] / fp["step_time_interval_s"]
        if fp["peak_above_start_bytes"]:
            row["peak_ratio_fp"] = fp["peak_above_start_bytes"] / row["peak_above_start_bytes"]
        if fp["held_bytes"]:
            row["held_ratio_fp"] = fp["held_bytes"] / row["held_bytes"]
    return {"rows": rows}


@contextlib.contextmanager
def _zero_value_readback(on: bool) -> Any:
    """With ``on``: zero-value packs read their count back (the sizing before 2026-11-27),
    for a paired comparison with the padded packs that never wait."""
    from actcore.compressors import zero_value

    pads = zero_value._pads
    if on:
        zero_value._pads = lambda x: False
    try:
        yield
    finally:
        zero_value._pads = pads


def _resnet_row(
    variant: str,
    device: Any,
    dry: bool,
    x: Any,
    y: Any,
    batch: int,
    size: int,
    repeats: int,
    rows: list[dict[str, Any]],
) -> None:
    """Measure one variant of ResNet-50 into ``rows``."""
    import torch

    model = _resnet(variant.removesuffix("-readback"), device, dry)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(model: Any = model, opt: Any = opt) -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    for _ in range(2 if not dry else 1):
        step()
    opt.zero_grad(set_to_none=True)
    row = {"variant": variant, "batch": batch, "image_size": size, **_peak(step, device)}
    row["held_bytes"] = _held(model, x, device)
    row["step_time_s"] = _median_time(step, device, repeats)
    # steady state: one whole replan interval (the median above is of steps that all
    # take adaptive statistics, as every step before the first replan does)
    row["step_time_interval_s"] = _interval_time(
        step, device, done=INTERVAL if dry else 3 + repeats, steps=2 if dry else INTERVAL
    )
    rows.append(row)


def part_compiled(dry: bool, out: Path) -> dict[str, Any]:
    """ResNet-50 (the dry run: ResNet-18, ``aot_eager``) compiled as it is and converted at
    L3, bf16 autocast: the median step after the two that compile, the bytes one forward
    keeps, and the converted model's gradient cosine to the plain one's on one batch (the
    compile issue's GPU target: compiled L3 within 1.1x compiled plain)."""
    import torch

    device = _device(dry)
    batch, size, repeats = (2, 32, 1) if dry else (64, 224, 10)
    backend = "aot_eager" if dry else "inductor"
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    rows: list[dict[str, Any]] = []
    grads = []
    for variant in ("fp", "L3"):
        model = _resnet(variant, device, dry)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        step = _classifier_step(compiled, x, y, device)
        t0 = time.perf_counter()
        for _ in range(2):  # (compiles forward and backward)
            step()
        _sync(device)
        row: dict[str, Any] = {"variant": variant, "batch": batch, "backend": backend}
        row["compile_s"] = time.perf_counter() - t0
        row["held_bytes"] = _held(compiled, x, device)
        row["step_time_s"] = _median_time(step, device, repeats)
        torch.manual_seed(1)
        step()
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters()]))
        rows.append(row)
        _write(out / "part-compiled.partial.json", rows)
        del model, compiled
        _free(device)
    fp = rows[0]
    for row, g in zip(rows, grads, strict=True):
        row["step_vs_fp"] = row["step_time_s"] / fp["step_time_s"]
        row["grad_cosine"] = float(torch.nn.functional.cosine_similarity(g, grads[0], 0))
        if fp["held_bytes"]:
            row["held_ratio_fp"] = fp["held_bytes"] / row["held_bytes"]
    return {"rows": rows}


def _llama(variant: str, device: Any, dry: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import act_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64 if dry else 512,
        intermediate_size=128 if dry else 1376,
        num_hidden_layers=2 if dry else 4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    if variant.startswith("ckpt"):
        model.gradient_checkpointing_enable()
    if variant.endswith("act"):
        act_hf.convert(model)
    return model.to(device).train()


def part_llama(dry: bool, out: Path) -> dict[str, Any]:
    """Bytes held between forward and backward (memory_allocated after the forward minus
    before it), the forward+backward peak, and step time; bf16 autocast, batch 2. The
    variants: plain sdpa, checkpointing, ``act_hf.convert`` (the layer route), both, and
    the saved-tensor hooks route at L2 on the plain model."""
    import torch

    device = _device(dry)
    seq, repeats = (64, 1) if dry else (4096, 3)
    ids = torch.randint(0, 1000, (2, seq), device=device)
    rows = []
    ref_grads = None
    for variant in ("sdpa", "ckpt", "act", "ckpt+act", "hooks:G2"):
        model = _llama(variant, device, dry)
        level = variant.split(":")[1] if variant.startswith("hooks:") else None

        def forward(model: Any = model, level: str | None = level) -> Any:
            import actcore

            saved = (
                actcore.compress_saved_tensors(level, model=model)
                if level
                else contextlib.nullcontext()
            )
            with _autocast(device), saved:
                return model(input_ids=ids, labels=ids, use_cache=False).loss

        forward().backward()  # the first step (the loss finds the head)
        model.zero_grad(set_to_none=True)
        row: dict[str, Any] = {"variant": variant, "seq": seq, "batch": 2}
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            loss = forward()
            _sync(device)
            row["held_bytes"] = torch.cuda.memory_allocated(device) - before
            loss.backward()
            _sync(device)
            row["peak_above_start_bytes"] = torch.cuda.max_memory_allocated(device) - before
        else:
            from actcore.memory import profiled_bytes

            loss, row["held_bytes"] = profiled_bytes(forward)
            loss.backward()
        grads = torch.cat([p.grad.flatten().double() for p in model.parameters()])
        ref_grads = grads if ref_grads is None else ref_grads
        row["grad_cosine"] = torch.nn.functional.cosine_similarity(ref_grads, grads, 0).item()
        row["step_time_s"] = _median_time(lambda f=forward: f().backward(), device, repeats)
        model.zero_grad(set_to_none=True)
        rows.append(row)
        _write(out / "part-llama.partial.json", rows)
        del model, forward, loss, grads
        _free(device)
    base = {r["variant"]: r for r in rows}
    for row in rows:
        row["held_ratio_sdpa"] = base["sdpa"]["held_bytes"] / max(row["held_bytes"], 1)
        row["held_ratio_ckpt"] = base["ckpt"]["held_bytes"] / max(row["held_bytes"], 1)
        row["step_vs_sdpa"] = row["step_time_s"] / base["sdpa"]["step_time_s"]
    return {"rows": rows}


def part_plan_time(dry: bool, out: Path) -> dict[str, Any]:
    """The fastest plan that fits (``fit_budget(order="time")``) on the Llama 4x512 (bf16
    autocast, batch 2), at 40%, 20% and 10% of its exact bytes, beside checkpointing alone
    at the same budget (``levels=("L0",)``): per plan, what a forward leaves allocated
    (``memory_allocated``) against the budget and the prediction, a step's peak above its
    start, the step time and tokens per second against plain sdpa's, the planning
    seconds, and what the plan chose."""
    import copy

    import torch

    import act_hf
    import actcore

    device = _device(dry)
    seq, batch, repeats = (64, 2, 1) if dry else (4096, 2, 3)
    ids = torch.randint(0, 1000, (batch, seq), device=device)
    plain = _llama("sdpa", device, dry)

    def forward(m: Any) -> Any:
        with _autocast(device):
            return m(input_ids=ids, labels=ids, use_cache=False).loss

    def step_of(m: Any) -> Callable[[], None]:
        def step() -> None:
            m.zero_grad(set_to_none=True)
            forward(m).backward()

        return step

    def held(m: Any) -> int | None:
        if device.type != "cuda":
            return None
        m.zero_grad(set_to_none=True)
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        loss = forward(m)
        _sync(device)
        kept = torch.cuda.memory_allocated(device) - before
        loss.backward()
        m.zero_grad(set_to_none=True)
        return kept

    def measured(m: Any, plan: Any, seconds: float) -> dict[str, Any]:
        step = step_of(m)
        step()
        row = {
            "kept_bytes": plan.kept_bytes,
            "predicted_bytes": plan.predicted_bytes,
            "held_bytes": held(m),
            "plan_seconds": seconds,
            "plan": plan.describe(),
            "predicted_step_s": plan.step_seconds,
        }
        row.update(_peak(step, device))
        row["step_time_s"] = _median_time(step, device, repeats)
        row["tokens_per_s"] = batch * seq / row["step_time_s"]
        return row

    result: dict[str, Any] = {"seq": seq, "batch": batch, "rows": []}
    step_of(plain)()
    result["plain_step_s"] = _median_time(step_of(plain), device, repeats)
    result["plain_held_bytes"] = held(plain)
    model = act_hf.convert(copy.deepcopy(plain), level="L2")  # the scope, switched per layer
    ckpt = act_hf.convert(copy.deepcopy(plain), level="L0")
    exact = actcore.fit_budget(model, forward, 2**62, recompute=False, order="time").exact_bytes
    result["exact_bytes"] = exact
    for share in (0.4, 0.2, 0.1):
        budget = int(share * exact)
        row: dict[str, Any] = {"share": share, "budget": budget}
        for name, m, kwargs in (
            ("plan", model, {"order": "time"}),
            ("ckpt", ckpt, {"levels": ("L0",), "order": "bytes"}),
        ):
            t0 = time.perf_counter()
            try:
                plan = actcore.fit_budget(m, forward, budget, **kwargs)
            except ValueError as err:
                row[name] = {"error": str(err)[:300]}
                continue
            row[name] = measured(m, plan, time.perf_counter() - t0)
            row[name]["step_vs_plain"] = row[name]["step_time_s"] / result["plain_step_s"]
            _free(device)
        if "step_time_s" in row["plan"] and "step_time_s" in row.get("ckpt", {}):
            row["plan_vs_ckpt"] = row["plan"]["step_time_s"] / row["ckpt"]["step_time_s"]
        result["rows"].append(row)
        _write(out / "part-plan-time.partial.json", result)
    return result


def part_profile(dry: bool, out: Path) -> dict[str, Any]:
    """Where an L3 ResNet-50 step spends its time: host (Python, dispatch) against device
    kernels, and the ops that cost most of each (torch.profiler, one step after 3 warm; for
    ``L3-steady`` one step after the first replan, which takes no adaptive statistics)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = _device(dry)
    batch, size = (2, 32) if dry else (64, 224)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    result: dict[str, Any] = {}
    for variant, warm in (("fp", 3), ("L3", 3), ("L3-steady", INTERVAL + 1)):
        model = _resnet(variant.removesuffix("-steady"), device, dry)

        step = _classifier_step(model, x, y, device)
        for _ in range(warm):
            step()
        _sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            step()
            _sync(device)
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        dev_attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        by_dev = sorted(events, key=lambda e: getattr(e, dev_attr, 0), reverse=True)
        by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        result[variant] = {
            "wall_s": wall,
            "ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "device_s": sum(getattr(e, dev_attr, 0) for e in events) / 1e6,
            "top_device": [
                (e.key[:60], e.count, round(getattr(e, dev_attr, 0) / 1e3, 2)) for e in by_dev[:15]
            ],
            "top_host": [
                (e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in by_cpu[:15]
            ],
        }
        _write(out / "part-profile.partial.json", result)
        del model, step
        _free(device)
    return result


def part_peak_trace(dry: bool, out: Path) -> dict[str, Any]:
    """Where a ResNet-50 step (batch 512) reaches its peak: the allocator's high mark between
    consecutive marks, one after each leaf module's forward and one before each autograd
    node's backward."""
    import torch

    device = _device(dry)
    cuda = device.type == "cuda"
    batch, size = (2, 32) if dry else (512, 224)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    result: dict[str, Any] = {}
    for variant in ("fp", "ckpt", "L3"):
        model = _resnet(variant, device, dry)
        marks: list[tuple[str, int, int]] = []

        def mark(tag: str, marks: list = marks) -> None:
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            marks.append((tag, peak, torch.cuda.memory_allocated() if cuda else 0))
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        handles = [
            mod.register_forward_hook(lambda m, i, o, n=name: mark("f " + n))
            for name, mod in model.named_modules()
            if next(mod.children(), None) is None
        ]
        model.zero_grad(set_to_none=True)
        _sync(device)
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with _autocast(device):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        mark("loss")
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            tag = f"b {node.name()} #{len(seen)}"
            handles.append(node.register_prehook(lambda g, t=tag: mark(t)))
            todo.extend(fn for fn, _ in node.next_functions)
        loss.backward()
        _sync(device)
        mark("end")
        for h in handles:
            h.remove()
        top = sorted(marks, key=lambda m: m[1], reverse=True)[:8]
        after_forward = next(m for m in marks if m[0] == "loss")[2]
        result[variant] = {
            "batch": batch,
            "base_mib": round(base / 2**20),
            "peak_above_base_mib": round((top[0][1] - base) / 2**20),
            "after_forward_mib": round((after_forward - base) / 2**20),
            "top_intervals_mib": [
                (t, round((p - base) / 2**20), round((a - base) / 2**20)) for t, p, a in top
            ],
        }
        _write(out / "part-peak-trace.partial.json", result)
        del model, loss, marks, handles, seen, todo
        _free(device)
    return result


def _max_batch(variant: str, dry: bool, out: Path) -> dict[str, Any]:
    """Doubling from 32, then bisection; each try is written out as it finishes."""
    import torch

    from actcore.bench import maxbatch

    device = _device(dry)
    size = 32 if dry else 224
    model = _resnet(variant, device, dry)
    cfg = maxbatch.MaxBatchConfig(amp="bf16", device=str(device))
    tries: list[dict[str, Any]] = []
    state = {"variant": variant, "image_size": size, "max_batch": 0, "tries": tries}

    def attempt(batch: int) -> bool:
        if dry:
            fit = batch <= 4
            model(torch.randn(2, 3, size, size)).sum().backward()
            seconds = 0.0 if fit else None
        else:
            seconds = maxbatch.fits(model, (3, size, size), 1000, batch, cfg)
        tries.append({"batch": batch, "fits": seconds is not None, "step_time_s": seconds})
        if seconds is not None:
            state["max_batch"] = max(state["max_batch"], batch)
        _write(out / f"part-max-batch-{variant}.partial.json", state)
        return seconds is not None

    good, batch = 0, 2 if dry else 32
    while attempt(batch):
        good, batch = batch, batch * 2
    bad = batch
    while bad - good > max(1, good // 32):  # within 3%: enough for a ratio
        mid = (good + bad) // 2
        if attempt(mid):
            good = mid
        else:
            bad = mid
    return state


def part_budget(dry: bool, out: Path) -> dict[str, Any]:
    """actcore's memory planner on the device (ResNet-50, bf16 autocast): ``fit_budget``'s
    plans on a step's peak (``bound="peak"``) at budgets from the exact step's peak down to
    the least plan's, each with its predicted peak against the peak of a training step
    (``max_memory_allocated``, gradients allocated before it); then ``max_batch`` at the
    default budget (free memory less gradients, on the peak) and whether a step of that
    batch, and of smaller ones, fits."""
    import torch
    import torchvision

    import actcore
    from actcore.budget import step_peak
    from actcore.layers.base import QLayer

    device = _device(dry)
    batch, size = (4, 32) if dry else (128, 224)
    torch.manual_seed(0)
    model = (torchvision.models.resnet18() if dry else torchvision.models.resnet50()).to(device)
    model.train()
    actcore.convert(model, level="L0")
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def forward(m: Any, x: Any = x) -> Any:
        with _autocast(device):
            return m(x)

    def step() -> None:  # gradients kept (zeroed in place): the peak step_peak plans
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        with _autocast(device):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()

    def uniform(level: str) -> int:
        for m in model.modules():
            if isinstance(m, QLayer):
                m.act_level = level
        return step_peak(model, forward)

    result: dict[str, Any] = {"batch": batch, "image_size": size, "plans": []}
    exact, least = uniform("L0"), uniform("L3")
    result.update(exact_peak_bytes=exact, least_peak_bytes=least)
    for frac in (1.0, 0.6, 0.3, 0.1, 0.0):
        budget = int(least + frac * (exact - least)) + (0 if frac else 2**20)
        t0 = time.perf_counter()
        try:
            plan = actcore.fit_budget(model, forward, budget, recompute=False, bound="peak")
        except ValueError as err:
            result["plans"].append({"budget": budget, "error": str(err)[:300]})
            continue
        row: dict[str, Any] = {
            "budget": budget,
            "plan_seconds": time.perf_counter() - t0,
            "predicted_bytes": plan.kept_bytes,
            "predicted_peak_bytes": plan.peak_bytes,
            "order": plan.order,
            "gradient_error": plan.gradient_error,
            "levels": {
                lv: list(plan.levels.values()).count(lv) for lv in set(plan.levels.values())
            },
        }
        step()
        step()
        row["held_bytes"] = _held(model, x, device)
        step()
        _free(device)  # the reserved peak from an empty cache, as step_peak measures it
        row.update(_peak(step, device))
        row["step_time_s"] = _median_time(step, device, 1 if dry else 3)
        if row["held_bytes"]:
            row["held_over_predicted"] = row["held_bytes"] / plan.kept_bytes
            row["peak_over_budget"] = row["peak_above_start_bytes"] / budget
        result["plans"].append(row)
        _write(out / "part-budget.partial.json", result)
    model.zero_grad(set_to_none=True)
    _free(device)

    def inputs(b: int) -> Any:
        xb = torch.randn(b, 3, size, size, device=device)
        return lambda m: forward(m, xb)

    budget = None if device.type == "cuda" else least + 2**20
    result["default_budget"] = actcore.budget.default_budget(model) if budget is None else budget
    t0 = time.perf_counter()
    found = 0
    try:
        found, plan = actcore.max_batch(
            model,
            inputs,
            budget,
            start=1024 if not dry else 2,
            multiple_of=256 if not dry else 2,
            recompute=False,
            bound="peak",
        )
        result.update(max_batch=found, max_batch_plan=plan.state_dict())
    except Exception as err:  # recorded: the part goes on to what it can still measure
        result["max_batch_error"] = repr(err)[:500]
    result["max_batch_seconds"] = time.perf_counter() - t0
    _write(out / "part-budget.partial.json", result)
    _free(device)
    steps = []
    b = found
    while b >= 1 and len(steps) < 3 and not dry:
        steps.append(_budget_step(model, b, size, device))
        _write(out / "part-budget.partial.json", {**result, "steps": steps})
        if steps[-1]["fits"]:
            break
        b = b * 7 // 8 // 256 * 256
    result["steps"] = steps
    return result


def _budget_step(model: Any, batch: int, size: int, device: Any) -> dict[str, Any]:
    """One training step of ``batch`` images (bf16 autocast, gradients set to None before):
    its time and peaks, or the out-of-memory message and what the allocator held then."""
    import torch

    row: dict[str, Any] = {"batch": batch, "fits": False}
    _free(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    oom = None
    try:
        x = torch.randn(batch, 3, size, size, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        _sync(device)
        t0 = time.perf_counter()
        _classifier_step(model, x, y, device)()
        _sync(device)
        row.update(fits=True, step_time_s=time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as err:
        oom = str(err)[:400]
    x = y = None
    row.update(
        error=oom,
        peak_above_start_bytes=torch.cuda.max_memory_allocated(device) - start,
        reserved_peak_bytes=torch.cuda.max_memory_reserved(device),
    )
    model.zero_grad(set_to_none=True)
    _free(device)
    return row


PART_FUNCS: dict[str, Callable[[bool, Path], dict[str, Any]]] = {
    "env": part_env,
    "build": part_build,
    "tests": part_tests,
    "sync": part_sync,
    "kernels": part_kernels,
    "ncu": part_ncu,
    "resnet": part_resnet,
    "llama": part_llama,
    "profile": part_profile,
    "peak-trace": part_peak_trace,
    "max-batch-fp": lambda dry, out: _max_batch("fp", dry, out),
    "max-batch-ckpt": lambda dry, out: _max_batch("ckpt", dry, out),
    "max-batch-L3": lambda dry, out: _max_batch("L3", dry, out),
    "budget": part_budget,
    "plan-time": part_plan_time,
    "compiled": part_compiled,
}


# ---------------------------------------------------------------------------- driver
def summary(results: dict[str, Any]) -> list[str]:
    """The short text table: one line per part, then the targets of the GPU issue."""
    lines = []
    for name, res in results["parts"].items():
        lines.append(f"{name:16s} {res['status']:8s} {res['seconds']:7.1f} s")
    get = results["parts"].get
    tests = (get("tests") or {}).get("result") or {}
    if "counts" in tests:
        lines.append(f"tests: {tests['counts']}; failed: {len(tests.get('failed', []))}")
    sync = (get("sync") or {}).get("result") or {}
    if sync.get("syncs") is not None:
        fp = (sync.get("fp") or {}).get("syncs")
        lines.append(
            f"syncs per steady step: L3 {sync['syncs']}, fp {fp} (target: no more than fp)"
        )
    kern = (get("kernels") or {}).get("result") or {}
    if kern.get("worst_pct_of_copy") is not None:
        lines.append(f"kernels: worst {kern['worst_pct_of_copy']:.0f}% of copy (target >= 80%)")
    for row in ((get("resnet") or {}).get("result") or {}).get("rows", []):
        peak = row.get("peak_above_start_bytes")
        lines.append(
            f"resnet50 {row['variant']:5s} step {row['step_time_s'] * 1e3:8.1f} ms "
            f"x{row.get('step_vs_fp', 0):.2f} (interval "
            f"x{row.get('interval_step_vs_fp', 0):.2f})  peak "
            + (f"{peak / 2**20:9.0f} MiB x{row.get('peak_ratio_fp', 0):.2f}" if peak else "-")
        )
    for row in ((get("llama") or {}).get("result") or {}).get("rows", []):
        lines.append(
            f"llama {row['variant']:9s} held {row['held_bytes'] / 2**20:8.1f} MiB "
            f"x{row['held_ratio_sdpa']:.2f} (vs ckpt x{row['held_ratio_ckpt']:.2f}) "
            f"cos {row['grad_cosine']:.4f} step x{row['step_vs_sdpa']:.2f}"
        )
    for row in ((get("compiled") or {}).get("result") or {}).get("rows", []):
        ratio = row.get("held_ratio_fp")
        lines.append(
            f"compiled resnet50 {row['variant']:3s} step {row['step_time_s'] * 1e3:8.1f} ms "
            f"x{row['step_vs_fp']:.2f} (target <= 1.1)  cos {row['grad_cosine']:.4f}"
            + (f"  held x{ratio:.2f}" if ratio else "")
        )
    batches = {}
    for variant in ("fp", "ckpt", "L3"):
        res = (get(f"max-batch-{variant}") or {}).get("result") or {}
        if res:
            batches[variant] = res["max_batch"]
    if batches:
        lines.append("max batch: " + ", ".join(f"{k} {v}" for k, v in batches.items()))
    budget = (get("budget") or {}).get("result") or {}
    for row in budget.get("plans", []):
        if "error" in row:
            lines.append(f"plan peak budget {row['budget'] / 2**20:8.0f} MiB: {row['error']}")
            continue
        held = row.get("held_over_predicted")
        peak = row.get("peak_over_budget")
        lines.append(
            f"plan peak budget {row['budget'] / 2**20:8.0f} MiB: kept "
            f"{row['predicted_bytes'] / 2**20:8.0f} MiB, step peak "
            f"{row['predicted_peak_bytes'] / 2**20:8.0f} MiB"
            + (f"; held x{held:.3f} of it, peak x{peak:.3f} of the budget" if held else "")
            + (
                f"; predicted error {row['gradient_error']:.1e}"
                if row.get("gradient_error") is not None
                else ""
            )
        )
    timed = (get("plan-time") or {}).get("result") or {}
    for row in timed.get("rows", []):
        parts = []
        for name in ("plan", "ckpt"):
            r = row.get(name, {})
            if "error" in r or not r:
                parts.append(f"{name}: none fits")
                continue
            held = r["held_bytes"] / row["budget"] if r.get("held_bytes") else None
            parts.append(
                f"{name} {r['tokens_per_s']:9.0f} tok/s, x{r['step_vs_plain']:.2f} plain"
                + (f", held x{held:.3f} of the budget" if held is not None else "")
            )
        lines.append(f"time plan at {row['share']:.0%} of exact: " + "; ".join(parts))
    if "max_batch" in budget:
        fitted = [s["batch"] for s in budget.get("steps", []) if s["fits"]]
        lines.append(
            f"max_batch at the default budget: {budget['max_batch']} "
            f"({budget['max_batch_seconds']:.0f} s); a step fits at {fitted or 'none tried'}"
        )
    return lines


def run_part(name: str, cap: float, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--part", name, "--out", str(args.out)]
    if args.dry_run:
        cmd.append("--dry-run")
    t0 = time.perf_counter()
    log = args.out / f"part-{name}.log"
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=cap).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
    res: dict[str, Any] = {"status": status, "seconds": time.perf_counter() - t0, "cap_s": cap}
    done = args.out / f"part-{name}.json"
    partial = args.out / f"part-{name}.partial.json"
    if done.is_file():
        res["result"] = json.loads(done.read_text())
    elif partial.is_file():
        res["partial"] = json.loads(partial.read_text())
    if status != "ok":
        res["log_tail"] = log.read_text()[-3000:]
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and text table")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, each part once")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all parts")
    p.add_argument("--parts", default=",".join(n for n, _ in PARTS))
    p.add_argument("--part", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        result = PART_FUNCS[args.part](args.dry_run, args.out)
        _write(args.out / f"part-{args.part}.json", result)
        return 0 if result.get("part_ok", True) else 1
    wanted = args.parts.split(",")
    unknown = sorted(set(wanted) - set(PART_FUNCS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PART_FUNCS)}")
    deadline = time.monotonic() + args.budget
    results: dict[str, Any] = {"benchmark": "gpu-check", "dry_run": args.dry_run, "parts": {}}
    for name, cap in PARTS:
        if name not in wanted:
            continue
        left = deadline - time.monotonic()
        if left < 5:
            results["parts"][name] = {"status": "skipped", "seconds": 0.0, "why": "budget"}
            _write(args.out / "gpu-check.json", results)
            (args.out / "gpu-check.txt").write_text("\n".join(summary(results)) + "\n")
            continue
        res = run_part(name, 300.0 if args.dry_run else min(cap, left), args)
        results["parts"][name] = res
        _write(args.out / "gpu-check.json", results)
        text = "\n".join(summary(results)) + "\n"
        (args.out / "gpu-check.txt").write_text(text)
        print(f"{name}: {res['status']} in {res['seconds']:.1f} s", flush=True)
    print((args.out / "gpu-check.txt").read_text())
    bad = [n for n, r in results["parts"].items() if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
