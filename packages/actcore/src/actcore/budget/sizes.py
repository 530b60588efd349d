"""The largest batch or sequence length whose forward fits a budget, and its plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..memory import format_bytes
from .checkpointing import set_recompute
from .plan import BOUNDS, ORDERS, MemoryPlan, parse_bytes
from .search import (
    OUT_OF_MEMORY,
    allowed_blocks,
    fit_budget,
    forward_of,
    inside,
    measure,
    planned_layers,
    preserved,
    step_peak_at,
)

__all__ = ["default_budget", "max_batch", "max_seq"]


def default_budget(model: nn.Module) -> int:
    """The bytes a CUDA model's activations may take: the device's free memory (what the
    driver has free and what torch's allocator holds cached but unused), less the
    gradients its trainable parameters do not hold yet. Tensors that exist count against
    it (the parameters, inputs made on the device); optimizer state only once it exists
    (after the first step), so plan after one step, or give the budget. Fragmentation is
    not foreseen. ValueError for a model that is not on a CUDA device."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(
            f"the default budget is the free memory of the model's CUDA device, and this "
            f"model is on {device}: give a budget, such as budget='2GiB'"
        )
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
    if free <= grads:
        raise ValueError(
            f"{device} has {format_bytes(free)} free, less than the "
            f"{format_bytes(grads)} its parameters' gradients will take"
        )
    return free - grads


def max_batch(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | float | str | None = None,
    *,
    levels: Sequence[str] = ("L0", "L1", "L2", "L3"),
    start: int | None = None,
    limit: int = 2**20,
    multiple_of: int = 1,
    recompute: bool | Sequence[str] = True,
    bound: str | None = None,
    order: str = "error",
) -> tuple[int, MemoryPlan]:
    """The largest batch whose activations fit ``budget`` at some plan, and that plan (set
    on ``model``, as :func:`fit_budget` sets it).

    ``make_inputs(batch)`` returns the example inputs of a batch of that size (a tensor, a
    tuple of positional arguments, a dict of keyword arguments, or a callable
    ``forward(model)``). A size fits when a forward of its inputs keeps at most ``budget``
    bytes with every Q-layer at the coarsest of ``levels``, or, where that keeps less, with
    every block ``recompute`` allows recomputed (see :func:`fit_budget`); sizes grow by
    doubling from ``start`` (default ``multiple_of``) until one does not fit (or ``limit``),
    then a bisection finds the last that does, in steps of ``multiple_of``. The plan for
    that size is :func:`fit_budget`'s: the finest levels that fit. ``budget``: bytes or a
    string such as ``"6GiB"``; ``None``, :func:`default_budget` (a CUDA model). ``bound``:
    what the budget bounds (see :func:`fit_budget`): ``"kept"``, the bytes a forward keeps
    for backward; ``"peak"``, a whole step's peak, where a size fits when its step at that
    least plan peaks within the budget too; ``None`` (default), ``"peak"`` for the default
    budget (the device's free memory bounds the whole step) and ``"kept"`` for a given one.
    A size whose forward or step runs out of device memory does not fit. The default budget
    is read at each size once its inputs exist, so inputs made on the device count.
    ``order``: how the plan for the size found orders its Q-layers (see :func:`fit_budget`);
    ``"error"`` runs its probe steps at that size, ``"bytes"`` none.

    Raises ValueError when even ``start`` does not fit, naming what it keeps.
    """
    return _largest(
        model,
        make_inputs,
        budget,
        levels,
        start,
        limit,
        multiple_of,
        recompute,
        bound,
        order,
        "batch",
    )


def max_seq(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | float | str | None = None,
    *,
    levels: Sequence[str] = ("L0", "L1", "L2", "L3"),
    start: int | None = None,
    limit: int = 2**20,
    multiple_of: int = 1,
    recompute: bool | Sequence[str] = True,
    bound: str | None = None,
    order: str = "error",
) -> tuple[int, MemoryPlan]:
    """:func:`max_batch` for a sequence length: ``make_inputs(length)`` returns the example
    inputs of that length (``multiple_of``: e.g. 64 for kernels that want aligned
    lengths)."""
    return _largest(
        model,
        make_inputs,
        budget,
        levels,
        start,
        limit,
        multiple_of,
        recompute,
        bound,
        order,
        "sequence",
    )


def _largest(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | float | str | None,
    levels: Sequence[str],
    start: int | None,
    limit: int,
    multiple_of: int,
    recompute: bool | Sequence[str],
    bound: str | None,
    order: str,
    what: str,
) -> tuple[int, MemoryPlan]:
    if start is None:
        start = multiple_of if isinstance(multiple_of, int) else 1
    for name, value in (("start", start), ("limit", limit), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if start % multiple_of or limit < start:
        raise ValueError(
            f"start ({start}) must be a multiple of multiple_of ({multiple_of}) and at most "
            f"limit ({limit})"
        )
    if bound is None:
        bound = "peak" if budget is None else "kept"
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS} or None, got {bound!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    given = None if budget is None else parse_bytes(budget)
    limits: dict[int, int] = {}  # size -> its budget (the default: read once its inputs exist)
    names, layers = planned_layers(model, levels, scope=order == "time")
    blocks = allowed_blocks(model, recompute)
    # the least a size can keep: every Q-layer at the coarsest level, or (where recomputing
    # saves bytes: a recomputed block keeps its input exact) every allowed block recomputed
    coarsest = dict.fromkeys(layers, names[-1])
    recomputed = {n: names[0] if inside(n, blocks) else names[-1] for n in layers}
    measured: dict[int, int] = {}  # size -> the least its forward keeps
    peaks: dict[int, int] = {}  # size -> its step's peak at that plan (bound "peak")

    def configure(on: bool) -> dict[str, str]:
        for name in blocks:
            set_recompute(model.get_submodule(name), on)
        return recomputed if on else coarsest

    def fits(size: int) -> bool:
        if size not in measured:
            forward = forward_of(make_inputs(size))
            limits[size] = default_budget(model) if given is None else given
            budget_bytes = limits[size]
            least, on = measure(model, layers, forward, configure(False))[0], False
            if blocks and least > budget_bytes:
                again = measure(model, layers, forward, configure(True))[0]
                least, on = min(least, again), again < least
            measured[size] = least
            if bound == "peak" and least <= budget_bytes:
                peaks[size] = step_peak_at(model, layers, forward, configure(on))
        return max(measured[size], peaks.get(size, 0)) <= limits[size]

    with preserved(model, layers):
        if not fits(start):
            least, budget_bytes = measured[start], limits[start]
            if max(least, peaks.get(start, 0)) == OUT_OF_MEMORY:
                raise ValueError(
                    f"no {what} fits: a {what} of {start} runs out of device memory (every "
                    f"Q-layer at {names[-1]}" + (", or blocks recomputed)" if blocks else ")")
                )
            how = f"every Q-layer at {names[-1]}" + (
                f", or {len(blocks)} blocks recomputed" if blocks else ""
            )
            if least <= budget_bytes:
                raise ValueError(
                    f"no {what} fits a step peak of {format_bytes(budget_bytes)}: the step of "
                    f"a {what} of {start} peaks at {format_bytes(peaks[start])} ({how})"
                )
            raise ValueError(
                f"no {what} fits a budget of {format_bytes(budget_bytes)}: a {what} of "
                f"{start} keeps at least {format_bytes(least)} ({how})"
            )
        good, bad = start, None  # good fits; bad (once found) does not
        while bad is None and good < limit:
            step = min(limit, good * 2) // multiple_of * multiple_of
            if step <= good:
                break
            if fits(step):
                good = step
            else:
                bad = step
        while bad is not None and bad - good > multiple_of:
            mid = (good + bad) // 2 // multiple_of * multiple_of
            if mid <= good:
                break
            if fits(mid):
                good = mid
            else:
                bad = mid
    inputs = make_inputs(good)
    budget_bytes = default_budget(model) if given is None else given
    plan = fit_budget(
        model, inputs, budget_bytes, levels=names, recompute=blocks, bound=bound, order=order
    )
    return good, plan
