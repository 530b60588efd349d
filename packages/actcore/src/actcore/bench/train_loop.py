"""One ``actcore bench train`` run: a task's model trained at one level from one seed
(:func:`train_run`), then the bytes one training forward keeps for backward, counted two
ways (:func:`measure_memory`)."""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import memory as act_memory
from ..ops import reset_seed_stream
from .memory import sync_device
from .tasks import Task, lr_lambda
from .train_config import BUDGET, TrainConfig, Variant, applied_variant, resolve_device

__all__ = ["GRAD_CLIP", "measure_memory", "train_run"]

GRAD_CLIP = 1.0


def _profiler_bytes(prof: Any, device: torch.device) -> int:
    """Net bytes allocated on ``device`` by the profiled events (allocations minus frees)."""
    total = 0
    for event in prof.events():
        if device.type == "cpu":
            total += event.self_cpu_memory_usage
        else:
            total += getattr(event, "self_device_memory_usage", 0) or getattr(
                event, "self_cuda_memory_usage", 0
            )
    return total


def measure_memory(
    task: Task, model: nn.Module, device: torch.device, compiled: bool = False
) -> dict[str, Any]:
    """Bytes one training forward on a fixed batch keeps for backward, two ways.

    ``retained_bytes``: :func:`actcore.memory.track`. ``profiler_bytes``: what
    ``torch.profiler`` saw the same forward leave allocated; the batch is copied inside the
    window so that both count it, and the scalar loss (allocated, not saved) is subtracted,
    so the two agree exactly for plain PyTorch. ``profiler_minus_tracked`` is the rest:
    state the forward allocated and kept outside autograd's saved tensors (e.g. caches).
    ``compiled``: a compiled model saves ACT's packings inside its graphs, out of the
    tracker's sight, so only the profiler measures it (the tracker's figures are None).
    """
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler chatter on stderr
    x, y = task.fixed_batch()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    model.train()
    gc.collect()
    sync_device(device)
    with profile(activities=activities, profile_memory=True) as prof:
        with act_memory.track(model) as mem:
            loss = task.loss(model, x.clone(), y.clone())
        sync_device(device)
    profiler = _profiler_bytes(prof, device) - loss.nelement() * loss.element_size()
    loss.backward()
    model.zero_grad(set_to_none=True)
    if compiled:
        return {"retained_bytes": None, "profiler_bytes": profiler}
    return {
        "retained_bytes": mem.retained_bytes,
        "profiler_bytes": profiler,
        "profiler_minus_tracked": profiler - mem.retained_bytes,
        "retained_by_module": mem.by_module,
    }


def _fixed_batch_loss(task: Task) -> Callable[[nn.Module], torch.Tensor]:
    """The loss of the task's fixed batch: the forward a budget variant plans on (made only
    for one, so other variants hold no extra batch through their run)."""
    x, y = task.fixed_batch()
    return lambda m: task.loss(m, x, y)


def _plan_record(plan: Any) -> dict[str, Any]:
    """What a budget variant's :class:`~actcore.budget.MemoryPlan` chose, for the JSON."""
    counts: dict[str, int] = {}
    for level in plan.levels.values():
        counts[level] = counts.get(level, 0) + 1
    return {
        "budget_bytes": plan.budget,
        "kept_bytes": plan.kept_bytes,
        "exact_bytes": plan.exact_bytes,
        "layers_at": counts,
        "recompute": list(plan.recompute),
        "gradient_error": plan.gradient_error,
    }


def train_run(
    cfg: TrainConfig,
    task: Task,
    v: Variant,
    seed: int,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """Train ``task``'s model at ``v`` from ``seed``; returns the run's record."""
    assert cfg.steps and cfg.eval_interval and cfg.lr
    device = resolve_device(cfg.device)
    torch.manual_seed(seed)
    reset_seed_stream()  # the same stochastic rounding for the same seed, run after run
    model = task.build_model()
    batches = task.batches(torch.Generator().manual_seed(seed))
    curve: list[dict[str, Any]] = []
    train_curve: list[list[float]] = []  # [step, mean training loss of the last log_every]
    log_every = max(1, cfg.eval_interval // 10)
    times: list[float] = []
    since_eval: list[float] = []
    since_log: list[float] = []
    diverged_at = None
    desc = f"{task.name} {v.label} seed {seed}"
    example = _fixed_batch_loss(task) if v.route == BUDGET else None
    with applied_variant(model, v, example) as (iterate, level):
        if cfg.compile:
            model.compile()  # (in place: state_dict keys, optimizer and hooks as they are)
        opt = task.optimizer(model, cfg.lr)
        warmup = min(100, max(1, cfg.steps // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps, warmup))
        curve.append({"step": 0, "train_loss": None, **task.evaluate(model)})
        t_run = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            x, y = next(batches)

            def backprop(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = task.loss(model, x, y)
                loss.backward()
                return loss.detach()

            sync_device(device)
            t0 = time.perf_counter()
            loss = backprop()
            if iterate is not None:  # the Controller re-plans bits here (grads restored)
                iterate(backprop)
            nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            sched.step()
            value = loss.item()  # syncs
            times.append(time.perf_counter() - t0)
            since_eval.append(value)
            since_log.append(value)
            if not math.isfinite(value):
                diverged_at = step
            if step % log_every == 0 or step == cfg.steps or diverged_at:
                train_curve.append([step, statistics.fmean(since_log)])
                since_log = []
            if step % cfg.eval_interval == 0 or step == cfg.steps or diverged_at:
                point = {"step": step, "train_loss": statistics.fmean(since_eval)}
                point.update(task.evaluate(model))
                curve.append(point)
                since_eval = []
                desc = f"{task.name} {v.label} seed {seed} (val loss {point['val_loss']:.3f})"
            advance(1, description=desc)
            if diverged_at:
                advance(cfg.steps - step)
                break
        train_time = time.perf_counter() - t_run
        mem = measure_memory(task, model, device, compiled=cfg.compile)
        plan = model.__dict__.get("act_memory_plan")  # a budget variant's
    final = curve[-1]
    return {
        "seed": seed,
        "actcore_level": level,
        "final_val_loss": final["val_loss"],
        "final_accuracy": final.get("accuracy"),
        "diverged_at_step": diverged_at,
        "step_time_s": statistics.median(times),
        "train_time_s": train_time,
        "steps_run": len(times),
        **mem,
        **({} if plan is None else {"memory_plan": _plan_record(plan)}),
        "curve": curve,
        "train_curve": train_curve,
    }
