"""``actcore bench zoo``: torchvision classifiers as their users write them, side by side.

Per model (random weights, train mode, cross-entropy on random labels) and per variant:

* ``fp``: the plain model, the reference;
* ``L2``, ``L3``...: ``actcore.convert(model, level)`` with no other option;
* ``L3-layers``: the same with ``layers_only=True`` (Q-layers only, the rest fp32);
* ``ckpt``: ``torch.utils.checkpoint`` around every block of the model's stages;
* ``VARIANT@compiled``: that variant under ``torch.compile`` (inductor, or ``--compile``'s
  backend); ``@float8``: compiled with inductor's own activation quantization (the
  partitioner's ``activation_quantization_aten_pass``, float8 e5m2, here for float32 and
  bfloat16 tensors of every size: by default it takes only bfloat16 ones of 100 MB and
  more); ``@budget0.5`` (any fraction): compiled with the partitioner's
  ``activation_memory_budget`` (recompute chosen by a knapsack). So ``fp@compiled,
  fp@float8, fp@budget0.5, L3, L3@compiled`` set PyTorch's compiled passes beside ACT.

Bytes held for backward are counted by the profiler (:func:`actcore.memory.profiled_bytes`,
independent of actcore's accounting) and by :func:`actcore.memory.track`; the forward output
is compared bitwise with fp's (same RNG), the gradient by its cosine to fp's on the same
batch, and the step (forward + backward) time is the median of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .. import budget
from .. import memory as act_memory
from . import report
from .models import build_model, check_model, default_image_size, logits

__all__ = [
    "CHECKPOINT",
    "COMPILE_MODES",
    "DEFAULT_MODELS",
    "FP",
    "LAYERS_SUFFIX",
    "ZooConfig",
    "apply_variant",
    "check_variant",
    "checkpoint_blocks",
    "columns",
    "compile_mode",
    "compile_settings",
    "grad_cosine",
    "main",
    "measure_model",
    "register",
]

FP = "fp"
LAYERS_SUFFIX = "-layers"
CHECKPOINT = "ckpt"
COMPILE_MODES = ("compiled", "float8", "budget")
"""What may follow ``@`` in a variant (``budget`` with a fraction: ``budget0.5``)."""
DEFAULT_MODELS = [
    "resnet50",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "convnext_tiny",
    "swin_t",
    "vit_b_16",
]


@dataclass
class ZooConfig:
    """What ``bench zoo`` measures."""

    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    levels: list[str] = field(default_factory=lambda: ["L2", "L3", "L3-layers", CHECKPOINT])
    batch: int = 4
    image_size: int | None = None
    steps: int = 3
    seed: int = 0
    compile: str | None = None


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Recompute every block of the model's stages in backward, in place (non-reentrant
    checkpointing, names unchanged): the blocks :func:`actcore.budget.candidate_blocks`
    finds, ResNet's bottlenecks, ConvNeXt's and Swin's, ViT's encoder layers, MobileNet's
    and EfficientNet's. Returns their names."""
    names = budget.candidate_blocks(model)
    for name in names:
        budget.set_recompute(model.get_submodule(name), True)
    return names


def compile_mode(variant: str) -> tuple[str, str | None, float | None]:
    """``variant`` split at ``@``: the variant, its compile mode (None: eager) and, for
    ``budget``, the fraction. ValueError for a mode that is not one of
    :data:`COMPILE_MODES` or a fraction outside (0, 1]."""
    base, at, mode = variant.partition("@")
    if not at:
        return base, None, None
    if mode in ("compiled", "float8"):
        return base, mode, None
    if mode.startswith("budget"):
        try:
            fraction = float(mode[len("budget") :])
        except ValueError:
            fraction = -1.0
        if 0 < fraction <= 1:
            return base, "budget", fraction
    raise ValueError(
        f"unknown compile mode {mode!r} in {variant!r}; valid: @compiled, @float8, "
        "@budgetF with F in (0, 1] (e.g. @budget0.5)"
    )


@contextlib.contextmanager
def compile_settings(mode: str | None, fraction: float | None = None) -> Any:
    """PyTorch's own compiled passes for ``mode`` (see :func:`compile_mode`), set while a
    variant compiles and runs: ``"float8"`` inductor's activation quantization for float32
    and bfloat16 tensors of every size (float8 e5m2), ``"budget"`` the partitioner's
    ``activation_memory_budget=fraction``. Compile caches are off meanwhile (a cached graph
    would skip the passes)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if mode not in ("float8", "budget"):
        yield
        return
    options = {
        "allowed_dtypes": "torch.bfloat16;torch.float32",
        "size_in_mb": 0,
        "quant_type": "torch.float8_e5m2",
    }
    fusion = {"activation_quantization_aten_pass": options} if mode == "float8" else {}
    budget_fraction = fraction if mode == "budget" else functorch_config.activation_memory_budget
    with (
        inductor_config.patch(force_disable_caches=True),
        inductor_config.patch(
            post_grad_fusion_options={**inductor_config.post_grad_fusion_options, **fusion}
        ),
        functorch_config.patch(activation_memory_budget=budget_fraction),
    ):
        yield


def apply_variant(model: nn.Module, variant: str) -> nn.Module:
    """``model`` with ``variant`` applied (in place; its compile mode is not applied here)."""
    import actcore

    variant = compile_mode(variant)[0]
    if variant == FP:
        return model
    if variant == CHECKPOINT:
        checkpoint_blocks(model)
        return model
    if variant.endswith(LAYERS_SUFFIX):
        return actcore.convert(model, variant[: -len(LAYERS_SUFFIX)], layers_only=True)
    return actcore.convert(model, variant)


def _forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, *, track: bool = True
) -> tuple[torch.Tensor, int, int | None, list[torch.Tensor | None]]:
    """One seeded step: output, profiler bytes, tracked bytes (None without ``track``:
    a compiled model, which the tracker's module hooks would make recompile), gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with act_memory.track(model) if track else contextlib.nullcontext() as tracked:
        out, profiled = act_memory.profiled_bytes(model, x)
    out = logits(out)
    nn.functional.cross_entropy(out, y).backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return out.detach(), profiled, tracked.retained_bytes if track else None, grads


def grad_cosine(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Cosine of two lists of gradients (None where a parameter has none), in float64: over
    millions of entries a float32 cosine can read above 1."""
    pairs = [(u, v) for u, v in zip(a, b, strict=True) if u is not None and v is not None]
    x = torch.cat([u.flatten().double() for u, _ in pairs])
    y = torch.cat([v.flatten().double() for _, v in pairs])
    return float(nn.functional.cosine_similarity(x, y, dim=0))


def measure_model(
    name: str,
    variants: list[str],
    *,
    batch: int = 4,
    image_size: int | None = None,
    steps: int = 3,
    seed: int = 0,
    compile: str | None = None,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> list[dict[str, Any]]:
    """Rows for ``name``: fp first, then each variant (see the module docstring); with
    ``compile`` (a ``torch.compile`` backend), each variant runs compiled."""
    torch.manual_seed(seed)
    size = image_size or default_image_size(name)
    base, shape, classes = build_model(name, image_size=size)
    x = torch.randn(batch, *shape)
    y = torch.randint(0, classes, (batch,))
    rows: list[dict[str, Any]] = []
    ref: dict[str, Any] = {}
    for variant in [FP, *(v for v in variants if v != FP)]:
        advance(0, description=f"{name} {variant}")
        model = apply_variant(copy.deepcopy(base), variant)
        _, mode, fraction = compile_mode(variant)
        compiled = compile is not None or mode is not None
        if compiled:
            torch._dynamo.reset()
            model = torch.compile(model, backend=compile or "inductor")
        with compile_settings(mode, fraction):
            t0 = time.perf_counter()
            _forward_backward(model, x, y, seed + 1, track=not compiled)  # compiles, warms up
            first = time.perf_counter() - t0
            out, profiled, tracked, grads = _forward_backward(
                model, x, y, seed + 2, track=not compiled
            )
            times = []
            for i in range(steps):
                t0 = time.perf_counter()
                _forward_backward_plain(model, x, y, seed + 3 + i)
                times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {
            "benchmark": "zoo",
            "model": name,
            "variant": variant,
            "batch": batch,
            "image_size": size,
            "compile": compile or (mode and "inductor"),
            "compile_mode": mode,
            "first_step_s": first,
            "profiled_bytes": profiled,
            "retained_bytes": tracked,
            "step_time_s": statistics.median(times) if times else None,
        }
        if variant == FP:
            ref = {"out": out, "bytes": profiled, "grads": grads, "time": row["step_time_s"]}
        row["ratio"] = ref["bytes"] / profiled if profiled > 0 else None
        row["forward_equal"] = bool(torch.equal(out, ref["out"]))
        row["grad_cosine"] = grad_cosine(ref["grads"], grads)
        row["grads_finite"] = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        if ref["time"] and row["step_time_s"]:
            row["time_vs_fp"] = row["step_time_s"] / ref["time"]
        rows.append(row)
        advance(1)
    return rows


def _forward_backward_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    nn.functional.cross_entropy(logits(model(x)), y).backward()
    model.zero_grad(set_to_none=True)


def columns() -> list[report.Column]:
    return [
        report.Column("model", "model", justify="left"),
        report.Column("variant", "variant", justify="left"),
        report.Column("profiled_bytes", "held (profiler)", report.fmt_bytes),
        report.Column("ratio", "fp / variant", report.fmt_float(1, "x")),
        report.Column("forward_equal", "same forward", lambda v: "yes" if v else "NO"),
        report.Column("grad_cosine", "grad cosine", report.fmt_float(3)),
        report.Column("step_time_s", "step s", report.fmt_float(2)),
        report.Column("first_step_s", "first step s", report.fmt_float(1)),
        report.Column("time_vs_fp", "time / fp", report.fmt_float(2, "x")),
        report.Column("error", "error", justify="left"),
    ]


def register(subparsers: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench zoo``."""
    p = subparsers.add_parser(
        "zoo",
        help="torchvision classifiers: fp, convert levels, layers only, checkpointing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated model names")
    p.add_argument(
        "--levels",
        default="L2,L3,L3-layers,ckpt",
        help="variants: convert levels, LEVEL-layers (layers_only), ckpt (checkpointing); "
        "VARIANT@compiled, @float8 (inductor's activation quantization), @budget0.5 "
        "(activation_memory_budget) compile that variant",
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="run every variant under torch.compile with this backend (inductor, aot_eager...)",
    )
    common(p)
    p.set_defaults(func=main, validate=_validate)


def check_variant(variant: str) -> str:
    """``variant`` if valid, else ValueError naming it and what is allowed."""
    from ..config import LEVELS, level_spec

    base = compile_mode(variant)[0]  # (ValueError for a bad mode)
    if base in (FP, CHECKPOINT):
        return variant
    level = base[: -len(LAYERS_SUFFIX)] if base.endswith(LAYERS_SUFFIX) else base
    try:
        level_spec(level)  # the layer route's own resolver: zoo variants use convert
        return variant
    except ValueError:
        pass
    valid = [FP, CHECKPOINT, *LEVELS, *(f"{lv}{LAYERS_SUFFIX}" for lv in LEVELS)]
    raise ValueError(
        f"unknown variant {variant!r}; valid: {', '.join(valid)}, each optionally with "
        "@compiled, @float8 or @budgetF"
    )


def _validate(args: argparse.Namespace) -> None:
    args.models = [check_model(m.strip()) for m in args.models.split(",") if m.strip()]
    args.levels = [check_variant(v.strip()) for v in args.levels.split(",") if v.strip()]
    for name in ("batch", "steps"):
        if getattr(args, name) < (1 if name == "batch" else 0):
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")


def main(args: argparse.Namespace) -> int:
    cfg = report.config_from_args(ZooConfig, args)

    def measure(rows: list[dict[str, Any]], advance: Callable[..., None]) -> None:
        for name in cfg.models:
            try:
                rows.extend(
                    measure_model(
                        name,
                        cfg.levels,
                        batch=cfg.batch,
                        image_size=cfg.image_size,
                        steps=cfg.steps,
                        seed=cfg.seed,
                        compile=cfg.compile,
                        advance=advance,
                    )
                )
            except Exception as err:  # e.g. an input too small for it: a row says so
                rows.append({"benchmark": "zoo", "model": name, "error": str(err)[:200]})

    how = f", compiled ({cfg.compile})" if cfg.compile else ""
    title = f"torchvision zoo, batch {cfg.batch}{how}: activation memory, forward, gradient, time"
    return report.run_with_progress(
        "zoo",
        args,
        len(cfg.models) * (1 + len(cfg.levels)),
        measure,
        config=asdict(cfg),
        show=lambda rows: report.console().print(report.table(title, columns(), rows)),
    )
