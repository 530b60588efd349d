"""fit_budget: each Q-layer's level, and the blocks to recompute, chosen so that a forward
keeps at most a budget of bytes, measured (the package docstring says how)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..compressors.zero_value import settle
from ..config import level_spec
from ..convert import convert
from ..layers.base import QLayer
from ..layers.scope import scope_exact, set_scope_exact
from ..memory import format_bytes, track
from .checkpointing import candidate_blocks, inside, is_recomputed, set_recompute
from .costs import cached_step_times
from .errors import cached_layer_errors, cached_scope_errors
from .fastest import Problem, fastest_plan, scope_bytes, shared_inputs
from .order import bytes_path, error_path, refine
from .peak import step_peak
from .plan import (
    BOUNDS,
    ORDERS,
    OUT_OF_MEMORY,
    MemoryPlan,
    budget_share,
    parse_bytes,
    unless_out_of_memory,
)

__all__ = [
    "OUT_OF_MEMORY",
    "allowed_blocks",
    "fit_budget",
    "forward_of",
    "inside",
    "measure",
    "planned_layers",
    "preserved",
    "step_peak_at",
]

_PEAK_TRIES = 6


def forward_of(example_inputs: Any) -> Callable[[nn.Module], Any]:
    if callable(example_inputs) and not isinstance(example_inputs, torch.Tensor):
        return example_inputs  # forward(model) -> output
    if isinstance(example_inputs, Mapping):
        return lambda model: model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return lambda model: model(*example_inputs)
    return lambda model: model(example_inputs)


@contextlib.contextmanager
def preserved(model: nn.Module, layers: Mapping[str, QLayer]) -> Iterator[None]:
    """Undo what planning forwards leave behind: buffer updates (batch-norm statistics),
    draws from torch's generators (dropout), and the levels of ``layers`` and the blocks
    recomputed and the scope's choices that they were measured at. Inside, no block starts
    recomputed (a plan is made from scratch); after, the model is as before, and a plan
    sets its own."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    levels = {n: m.act_spec for n, m in layers.items()}
    recomputed = {id(m) for m in model.modules() if is_recomputed(m)}
    scope_states = {id(m): scope_exact(m) for m in model.modules()}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            for m in model.modules():
                set_recompute(m, False)
            yield
        finally:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in buffers:
                        b.copy_(buffers[n])
            for n, m in layers.items():
                m.act_spec = levels[n]
            for m in model.modules():
                set_recompute(m, id(m) in recomputed)
                if scope_exact(m) != scope_states.get(id(m)):
                    set_scope_exact(m, scope_states.get(id(m)))


def fit_budget(
    model: nn.Module,
    example_inputs: Any,
    budget: int | float | str,
    *,
    levels: Sequence[str] = ("L0", "L1", "L2", "L3"),
    recompute: bool | Sequence[str] = True,
    bound: str = "kept",
    order: str = "error",
    error_weight: float = 1.0,
) -> MemoryPlan:
    """Choose each Q-layer's level, and where compression alone cannot fit the blocks to
    recompute in backward, so that a forward of ``example_inputs`` keeps at most ``budget``
    bytes for backward (``bound="kept"``), or so that a whole training step peaks at most
    ``budget`` bytes above its start (``bound="peak"``), keeping as many layers as fine as
    the budget allows; set the plan on ``model`` and return the :class:`MemoryPlan`.

    ``model``: a model converted at the finest of ``levels`` (what no Q-layer saves is kept
    at the level it was converted at, so the finest end of the plan is that level
    throughout), or an unconverted one, which is converted so (in place). The Q-layers
    planned coarser run that level's fixed bits (adaptive bits stay off).
    ``example_inputs``: a tensor, a tuple of positional arguments, a dict of keyword
    arguments, or a callable ``forward(model)``; their shapes are the plan's (plan again for
    another batch or sequence length). ``budget``: bytes, a string such as ``"6GiB"``, or a
    share of the exact configuration's such as ``"10%"``: of what a forward with every
    Q-layer at the finest level keeps (``bound="kept"``), or of that configuration's step
    peak (``bound="peak"``, one more step measured); the plan's ``budget`` is then in bytes.
    ``levels``: the candidate levels from finest to coarsest. ``recompute``: the blocks
    that may be recomputed (non-reentrant checkpointing, dropout replayed): ``True``, those
    :func:`~actcore.budget.candidate_blocks` finds; a list of module names; ``False``, none.
    Blocks are recomputed only when every Q-layer at the coarsest level still keeps too
    much, and only blocks whose recompute saves bytes (a recomputed block keeps its input
    exact): the fewest that fit, the largest savings first, the Q-layers inside them exact
    (their saves are recomputed, not kept), the others planned in the rest.

    ``bound="peak"`` bounds what ``torch.cuda.max_memory_allocated`` sees during forward
    and backward (on a CPU, the profiler's allocation records), less what was allocated
    before the step, gradients included (:func:`~actcore.budget.step_peak`): what is kept
    plus the backward's temporaries, which grow as more layers are compressed (each
    decompresses what it kept). The plan is searched by bytes kept, its step measured, and
    searched again with the measured excess taken off until a step fits; the plan records
    that step's peak (``peak_bytes``). A configuration whose forward runs out of device
    memory counts as not fitting.

    ``order``: which Q-layers go coarser first. ``"error"`` (default): those that save the
    most bytes per unit of gradient error, the error each adds at each level measured by
    probe steps (:mod:`.errors`: ``1 + 8 * (levels - 1)`` forward and backward passes, once
    per model and shape of the example inputs; :func:`~actcore.budget.forget_errors`
    measures them again; none where every Q-layer fits exact); a layer may skip levels
    that save nothing. ``"bytes"``: those that save the most bytes, one level at a time,
    with no backward pass; also what the error order falls back to where its exact probe
    step runs out of device memory (the plan's ``order`` says which was used). The plan
    records the predicted relative squared gradient error (``gradient_error``, error order
    only). ``"time"``: the levels, the recomputed blocks and, per block and for the rest of
    the model, whether the model scope compresses what no Q-layer saves, together: those of
    least predicted step time plus ``error_weight`` times the exact step's time per unit of
    relative squared gradient error (:mod:`.fastest`: a knapsack over costs measured by
    timed steps, every Q-layer at each level, every block recomputed, the scope on in the
    rest and in the blocks, three rounds each, and the error probes; recompute is then a
    choice among the others, not only the way past the coarsest level); the plan records
    its predicted step time (``step_seconds``) and the scope's choices (``scope``). The
    scope is that of a model converted at a level of fixed bits that compresses, or of an
    unconverted one converted at the coarsest such candidate (``L2``); where the exact
    step runs out of device memory (no time can be measured), the error order plans it
    with the scope exact.

    Raises ValueError when even the least a plan can keep (or, with ``bound="peak"``, the
    least plan's step) is more than ``budget``, naming that smallest budget and how it is
    reached.
    """
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if isinstance(error_weight, bool) or not (
        isinstance(error_weight, (int, float)) and math.isfinite(error_weight) and error_weight >= 0
    ):
        raise ValueError(f"error_weight must be a finite number >= 0, got {error_weight!r}")
    share = budget_share(budget)
    budget_bytes = parse_bytes(budget) if share is None else 0  # a share: known once measured
    names, layers = planned_layers(model, levels, scope=order == "time")
    blocks = allowed_blocks(model, recompute)
    regions = blocks or candidate_blocks(model)  # what the time order's plan is made of
    has_scope = order == "time" and getattr(model, "act_scope", None) is not None
    units = ["", *regions] if has_scope else []  # where the scope is switched
    forward = forward_of(example_inputs)
    chosen: list[str] = []  # the blocks recomputed in the configuration measured next
    scoped: list[str] = []  # the units in which its scope compresses (exact in the others)
    measured: dict[tuple, tuple[int, dict[str, int]]] = {}

    def set_scope(on: Sequence[str]) -> None:
        for unit in units:
            set_scope_exact(model.get_submodule(unit), unit not in on)

    def set_recomputed_scope(recomputed: Sequence[str], on: Sequence[str]) -> None:
        """Recompute the blocks of ``recomputed`` (not the others); the scope on in ``on``."""
        for name in blocks:
            set_recompute(model.get_submodule(name), name in recomputed)
        set_scope(on)

    def kept(config: Mapping[str, str]) -> tuple[int, dict[str, int]]:
        """(Forwards are seeded, so a configuration measured once is not measured again.)"""
        key = (tuple(chosen), tuple(scoped), tuple(config[n] for n in layers))
        if key not in measured:
            set_recomputed_scope(chosen, scoped)
            measured[key] = measure(model, layers, forward, config)
        return measured[key]

    def peak(plan: MemoryPlan) -> int:
        set_recomputed_scope(plan.recompute, [u for u, on in plan.scope.items() if on])
        return step_peak_at(model, layers, forward, plan.levels)

    with preserved(model, layers):
        set_scope(())  # exact everywhere, as every configuration starts
        errors, norm = None, 0.0
        exact = dict.fromkeys(layers, names[0])
        exact_bytes, weights = kept(exact)
        if share is not None:
            whole = exact_bytes if bound == "kept" else step_peak_at(model, layers, forward, exact)
            if whole == OUT_OF_MEMORY:
                raise ValueError(
                    f"a budget of {budget!r} is a share of the exact configuration's "
                    f"{'bytes' if bound == 'kept' else 'step peak'}, which cannot be measured: "
                    "it runs out of device memory; give the budget in bytes"
                )
            budget_bytes = max(1, math.floor(share * whole))
        all_exact = bound == "kept" and exact_bytes <= budget_bytes  # nothing to order
        times, tied, unit_errors, packed_errors = None, [], None, None
        if order == "time" and not all_exact:
            times = unless_out_of_memory(
                lambda: cached_step_times(
                    model, layers, example_inputs, forward, names, blocks, units, set_scope
                )
            )
            if times is None:  # the exact step does not fit the device: no time to model,
                order = "error"  # levels and recompute by gradient error, the scope exact
            else:
                tied = shared_inputs(model, layers, forward)
        weighted = order == "error" or (order == "time" and error_weight > 0)
        if weighted and (len(names) > 1 or units) and not all_exact:
            found = unless_out_of_memory(
                lambda: cached_layer_errors(model, layers, example_inputs, forward, names, weights)
            )
            if found is None:
                order = "bytes"  # the exact step does not fit the device: by bytes alone
            else:
                errors, norm = found
            if units and found is not None:
                unit_errors = cached_scope_errors(
                    model,
                    layers,
                    example_inputs,
                    forward,
                    names[0],
                    units,
                    set_scope,
                    _scope_savings(kept, scoped, exact, units, regions, layers),
                )
            packable = [b for b in blocks if b in units]
            if packable and found is not None:  # recomputed, the input packed by the scope
                chosen[:] = blocks
                packed_errors = cached_scope_errors(
                    model,
                    layers,
                    example_inputs,
                    forward,
                    names[0],
                    packable,
                    lambda on: set_recomputed_scope(blocks, on),
                    _scope_savings(kept, scoped, exact, packable, regions, layers),
                    variant="recomputed",
                )
                chosen.clear()

        def plan_for(target: int) -> MemoryPlan:
            if order == "time" and times is not None:
                problem = Problem(
                    kept,
                    chosen,
                    scoped,
                    list(layers),
                    names,
                    regions,
                    blocks,
                    units,
                    times,
                    errors,
                    unit_errors,
                    norm,
                    error_weight,
                    tied,
                    packed_errors,
                )
                return fastest_plan(problem, target)
            return _plan(kept, chosen, list(layers), names, blocks, target, errors)

        if bound == "kept":
            plan = plan_for(budget_bytes)
        else:
            plan = _within_peak(plan_for, peak, budget_bytes)
        chosen.clear()  # each Q-layer's bytes at each level, as measured (more forwards
        scoped.clear()  # only after recompute or scope choices)
        tables = [kept(dict.fromkeys(layers, name))[1] for name in names]
    rank = {name: i for i, name in enumerate(names)}
    by_layer = {
        n: {name: t.get(n, 0) for name, t in zip(names, tables, strict=True)} for n in layers
    }
    extra: dict[str, Any] = {"layer_bytes": by_layer, "order": order}
    if errors is not None:
        scale = 1.0 / norm if norm > 0 else 0.0
        extra["layer_error"] = {
            n: {name: errors[i][n] * scale for i, name in enumerate(names)} for n in layers
        }
        extra["gradient_error"] = scale * (
            sum(errors[rank[lv]][n] for n, lv in plan.levels.items())
            + sum(
                ((packed_errors if u in plan.recompute else unit_errors) or {}).get(u, 0.0)
                for u, on in plan.scope.items()
                if on
            )
        )
    elif order == "error" and all_exact:
        extra["gradient_error"] = 0.0  # every Q-layer exact
    if units and not plan.scope:  # planned by levels alone: measured with the scope exact
        extra["scope"] = dict.fromkeys(units, False)
    plan = dataclasses.replace(plan, **extra)
    plan.apply(model)
    return plan


def _scope_savings(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    scoped: list[str],
    exact: Mapping[str, str],
    units: Sequence[str],
    regions: Sequence[str],
    layers: Mapping[str, QLayer],
) -> dict[str, int]:
    """The bytes the scope saves in each unit (every Q-layer exact): the key by which the
    error a run of units adds is split among them."""
    off = scope_bytes(kept(exact)[1], layers, regions)
    scoped[:] = units
    on = scope_bytes(kept(exact)[1], layers, regions)
    scoped.clear()
    return {u: max(0, off[u] - on[u]) for u in units}


def _within_peak(
    plan_for: Callable[[int], MemoryPlan], peak: Callable[[MemoryPlan], int], budget: int
) -> MemoryPlan:
    """The first plan by bytes kept whose step peaks within ``budget``: plan for a target,
    measure the step, lower the target by what the step took beyond the budget, again."""

    def fitted(plan: MemoryPlan, used: int) -> MemoryPlan:
        return dataclasses.replace(plan, budget=budget, bound="peak", peak_bytes=used)

    target = budget
    for _ in range(_PEAK_TRIES):
        plan = plan_for(target)  # ValueError: even what the least plan keeps is too much
        used = peak(plan)
        if used <= budget:
            return fitted(plan, used)
        if target <= plan.smallest_bytes:
            break
        transient = used - plan.kept_bytes if used != OUT_OF_MEMORY else target // 2
        target = max(plan.smallest_bytes, min(target - 1, budget - transient))
    else:  # not settled in _PEAK_TRIES plans: the plan that keeps the least decides
        plan = plan_for(plan.smallest_bytes)
        used = peak(plan)
        if used <= budget:
            return fitted(plan, used)
    step = (
        "runs out of device memory"
        if used == OUT_OF_MEMORY
        else f"peaks at {format_bytes(used)} ({used} bytes)"
    )
    raise ValueError(
        f"a step peak of {format_bytes(budget)} cannot be met: the step of the plan that "
        f"keeps the least ({format_bytes(plan.kept_bytes)}; {plan.describe()}) {step}"
    )


def allowed_blocks(model: nn.Module, recompute: bool | Sequence[str]) -> list[str]:
    """The names of the blocks ``recompute`` allows (see :func:`fit_budget`)."""
    if recompute is True:
        return candidate_blocks(model)
    if recompute is False:
        return []
    if isinstance(recompute, str) or not all(isinstance(n, str) for n in recompute):
        raise TypeError(f"recompute is True, False or a list of module names, got {recompute!r}")
    names = {n for n, _ in model.named_modules()}
    unknown = [n for n in recompute if n not in names or n == ""]
    if unknown:
        raise ValueError(
            f"cannot recompute {unknown}: {type(model).__name__} has no such submodule "
            f"(its blocks: {candidate_blocks(model) or 'none found'})"
        )
    return list(recompute)


def _plan(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    chosen: list[str],
    layers: list[str],
    names: list[str],
    blocks: list[str],
    budget: int,
    errors: list[dict[str, float]] | None = None,
) -> MemoryPlan:
    """Levels only where they fit; else the fewest blocks recomputed that fit at the coarsest
    level (``chosen``, which ``kept`` reads, is filled in), then the levels outside them.

    A recomputed block keeps its input exact instead of what its Q-layers keep, which can
    be more: each block's saving is measured (every block recomputed in one forward against
    none, by module), and only blocks that save bytes are recomputed, the largest savings
    first."""
    if not blocks:
        return _search(kept, layers, names, budget, errors)
    exact = kept(dict.fromkeys(layers, names[0]))[0]
    coarsest, coarse_by = kept(dict.fromkeys(layers, names[-1]))
    if coarsest <= budget:
        return _search(kept, layers, names, budget, errors)

    def config_for(recomputed: Sequence[str]) -> dict[str, str]:
        chosen[:] = recomputed
        return {n: names[0] if inside(n, chosen) else names[-1] for n in layers}

    every, every_by = kept(config_for(blocks))

    def under(by_module: Mapping[str, int], block: str) -> int:
        return sum(v for m, v in by_module.items() if inside(m, [block]))

    saving = {b: under(coarse_by, b) - under(every_by, b) for b in blocks}
    order = sorted((b for b in blocks if saving[b] > 0), key=lambda b: -saving[b])
    fewest = (
        every if len(order) == len(blocks) else kept(config_for(order))[0] if order else coarsest
    )
    smallest = min(coarsest, fewest)
    if smallest > budget:
        how = f"every Q-layer at {names[-1]}" + (
            f", {len(order)} of {len(blocks)} blocks recomputed"
            if fewest < coarsest
            else f"; recomputing any of the {len(blocks)} blocks keeps more, its input exact"
        )
        raise ValueError(
            f"a budget of {format_bytes(budget)} cannot be met: the least a plan keeps is "
            f"{format_bytes(smallest)} ({smallest} bytes, {how}), the smallest budget that "
            f"fits; exact ({names[0]}) keeps {format_bytes(exact)}"
        )
    lo, hi = 1, len(order)  # the fewest blocks that fit (all of them do)
    while lo < hi:
        mid = (lo + hi) // 2
        if kept(config_for(order[:mid]))[0] <= budget:
            hi = mid
        else:
            lo = mid + 1
    config_for(order[:lo])
    inner = [n for n in layers if inside(n, chosen)]
    free = [n for n in layers if n not in inner]

    def kept_free(config: Mapping[str, str]) -> tuple[int, dict[str, int]]:
        return kept({**dict.fromkeys(inner, names[0]), **config})

    plan = _search(kept_free, free, names, budget, errors) if free else None
    levels = {**dict.fromkeys(inner, names[0]), **(plan.levels if plan else {})}
    used = plan.kept_bytes if plan else kept(levels)[0]
    return MemoryPlan(budget, levels, used, exact, smallest, recompute=tuple(chosen))


def planned_layers(
    model: nn.Module, levels: Sequence[str], scope: bool = False
) -> tuple[list[str], dict[str, QLayer]]:
    """The candidate level names (checked) and the Q-layers of ``model``, converted at the
    finest level first where it is not converted yet. With ``scope`` (order ``"time"``),
    a model converted at a level of fixed bits that compresses keeps its scope, which the
    plan switches per block, and an unconverted one is converted at the coarsest such
    candidate (:func:`scope_level`)."""
    specs = [level_spec(level) for level in levels]  # ValueError naming an unknown level
    if not specs:
        raise ValueError("a memory plan needs at least one candidate level")
    names = [spec.name for spec in specs]
    report = getattr(model, "act_report", None)
    if report is None:
        convert(model, level=scope_level(names) if scope else names[0])
    elif scope and report.level != names[0] and level_spec(report.level).packs:
        if level_spec(report.level).adaptive:
            raise ValueError(
                f"a memory plan switches the scope of a model converted at a level of fixed "
                f"bits; this one was converted at {report.level!r}, whose adaptive bits change "
                "what it keeps from step to step: convert it at 'L2' (or 'L1') first"
            )
    elif report.level != names[0]:
        raise ValueError(
            f"a memory plan is made for a model converted at its finest level {names[0]!r}; "
            f"this one was converted at {report.level!r}, which also compresses what the "
            f"Q-layers keep exact: actcore.convert(model, level={names[0]!r}) first"
        )
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QLayer)}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no layer actcore can convert to plan")
    return names, layers


def scope_level(names: Sequence[str]) -> str:
    """The level at which order ``"time"`` converts a model for its scope: the coarsest
    candidate of fixed bits that compresses (``L2`` of the defaults), else the finest."""
    fixed = [n for n in names if level_spec(n).compresses and not level_spec(n).adaptive]
    return fixed[-1] if fixed else names[0]


def measure(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    forward: Callable[[nn.Module], Any],
    config: Mapping[str, str],
) -> tuple[int, dict[str, int]]:
    """Bytes one forward keeps for backward with each Q-layer at ``config``'s level, in all
    and by module (the Q-layers are left at those levels)."""
    for n, m in layers.items():
        m.act_level = config[n]
    torch.manual_seed(0)  # every configuration measured on the same dropout draw

    def run() -> Any:
        with track(model) as report:
            out = forward(model)
            settle(wait=True)  # CUDA: zero-value payloads at their exact size, as in training
        del out
        return report

    report = unless_out_of_memory(run)
    if report is None:
        return OUT_OF_MEMORY, {}
    return report.retained_bytes, dict(report.by_module)


def step_peak_at(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    forward: Callable[[nn.Module], Any],
    config: Mapping[str, str],
) -> int:
    """:func:`~actcore.budget.peak.step_peak` with each Q-layer at ``config``'s level
    (:data:`OUT_OF_MEMORY` when the step runs out of device memory)."""
    for n, m in layers.items():
        m.act_level = config[n]
    torch.manual_seed(0)
    peak = unless_out_of_memory(lambda: step_peak(model, forward))
    return OUT_OF_MEMORY if peak is None else peak


def _search(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    layers: list[str],
    names: list[str],
    budget: int,
    errors: list[dict[str, float]] | None = None,
) -> MemoryPlan:
    tables = [kept(dict.fromkeys(layers, name)) for name in names]
    exact, smallest = tables[0][0], tables[-1][0]
    if smallest > budget:
        raise ValueError(
            f"a budget of {format_bytes(budget)} cannot be met: with every Q-layer at "
            f"{names[-1]} a forward keeps {format_bytes(smallest)} ({smallest} bytes), the "
            f"smallest budget these levels fit; exact ({names[0]}) keeps {format_bytes(exact)}"
        )
    by_module = [t[1] for t in tables]
    path = (
        bytes_path(layers, by_module, names)
        if errors is None
        else error_path(layers, by_module, names, errors)
    )
    lo, hi = 0, len(path) - 1  # path[hi] is all coarsest: fits
    measured = {0: exact, hi: smallest}
    while lo < hi:  # the first configuration on the path that fits
        mid = (lo + hi) // 2
        if mid not in measured:
            measured[mid] = kept(path[mid])[0]
        if measured[mid] <= budget:
            hi = mid
        else:
            lo = mid + 1
    if lo not in measured:
        measured[lo] = kept(path[lo])[0]
    config, used = refine(kept, dict(path[lo]), measured[lo], by_module, names, budget, errors)
    return MemoryPlan(budget, config, used, exact, smallest)
