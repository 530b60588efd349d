"""Fitting a memory budget: the level of each Q-layer chosen so a forward keeps at most
``budget`` bytes for backward.

:func:`fit_budget` measures what the converted model keeps (:func:`actcore.memory.track`,
one forward of the example inputs) with every Q-layer at each candidate level, from exact
(``L0``) to the coarsest. Those per-module tables order the moves "one Q-layer one level
coarser" by the bytes they save, largest first, each layer's levels in order: a path of
configurations from all exact to all coarsest. Bytes are not quite additive across modules
(a tensor two layers share is kept once when they pack it alike, a ReLU's mask serves the
next layer at ``L3``), so the path is measured, not predicted: a bisection finds its first
configuration that fits, a few forwards in all; then the layers that the last step made
coarser than the budget needs go one level finer again while the tables say they fit
(the longest run of those moves that fits when measured). The plan is that
configuration, measured.

The planning forwards draw their random numbers (dropout) from one fixed seed, so every
configuration is measured on the same draw, and leave no trace: buffers (batch-norm
statistics) and torch's random state are restored after them. What a zero-value level
keeps depends on the data (a ReLU output's nonzeros): other inputs or dropout draws keep a
little more or less than the plan measured.

:func:`max_batch` and :func:`max_seq` find the largest batch or sequence length whose
activations fit a budget at the coarsest level (doubling, then a bisection), and plan it.

This is the first slice of the budget planner: Q-layer levels only (recompute, offload and
per-tensor choices are not planned yet), ordered by bytes saved (no gradient-error model
yet). The plan stays on the model and :mod:`actcore.resume` saves and restores it.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .compressors.zero_value import settle
from .config import level_spec
from .convert import convert
from .layers.base import QLayer
from .memory import format_bytes, track

__all__ = ["MemoryPlan", "default_budget", "fit_budget", "max_batch", "max_seq", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(size: int | float | str) -> int:
    """``size`` in bytes: an int, or a string such as ``"6GiB"``, ``"512 MiB"``, ``"1.5GB"``."""
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise TypeError(f"a memory size is an int of bytes or a string like '6GiB', got {size!r}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {size!r} as a memory size: use a number and one of "
                "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '6GiB')"
            )
        size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"a memory budget must be a positive number of bytes, got {size!r}")
    return int(size)


@dataclass(frozen=True)
class MemoryPlan:
    """The level of each Q-layer that :func:`fit_budget` chose, and what it measured."""

    budget: int  # bytes asked for
    levels: Mapping[str, str]  # Q-layer name -> level name
    kept_bytes: int  # what a forward of the example inputs keeps under this plan
    exact_bytes: int  # ... with every Q-layer at the finest candidate level
    smallest_bytes: int  # ... with every Q-layer at the coarsest one

    def apply(self, model: nn.Module) -> nn.Module:
        """Set each planned Q-layer of ``model`` to its level (and keep the plan on it, for
        :mod:`actcore.resume`); returns ``model``."""
        self.check(model)
        for name, level in self.levels.items():
            model.get_submodule(name).act_level = level
        model.__dict__["act_memory_plan"] = self
        return model

    def check(self, model: nn.Module) -> None:
        """ValueError unless every planned name is a Q-layer of ``model`` and every level is
        one of :data:`actcore.config.LEVELS`."""
        for name, level in self.levels.items():
            level_spec(level)  # ValueError naming an unknown level
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                layer = None
            if not isinstance(layer, QLayer):
                raise ValueError(
                    f"the memory plan sets {name!r} to {level}, but {type(model).__name__} has "
                    "no Q-layer of that name: load it into the model it was made for, "
                    "converted the same way"
                )

    def state_dict(self) -> dict[str, Any]:
        """The plan as plain data (:func:`actcore.resume.state_dict` saves it)."""
        return {
            "budget": self.budget,
            "levels": dict(self.levels),
            "kept_bytes": self.kept_bytes,
            "exact_bytes": self.exact_bytes,
            "smallest_bytes": self.smallest_bytes,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> MemoryPlan:
        """The plan :meth:`state_dict` saved (KeyError naming a missing field)."""
        fields = ("budget", "levels", "kept_bytes", "exact_bytes", "smallest_bytes")
        missing = [f for f in fields if f not in state]
        if missing:
            raise KeyError(f"a saved memory plan lacks {missing}; it has {sorted(state)}")
        return cls(**{f: state[f] for f in fields})

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for level in self.levels.values():
            counts[level] = counts.get(level, 0) + 1
        spread = ", ".join(f"{n} at {level}" for level, n in sorted(counts.items()))
        return (
            f"MemoryPlan: keeps {format_bytes(self.kept_bytes)} for a budget of "
            f"{format_bytes(self.budget)} (exact {format_bytes(self.exact_bytes)}, smallest "
            f"reachable {format_bytes(self.smallest_bytes)}); {spread}"
        )


def _forward_of(example_inputs: Any) -> Callable[[nn.Module], Any]:
    if callable(example_inputs) and not isinstance(example_inputs, torch.Tensor):
        return example_inputs  # forward(model) -> output
    if isinstance(example_inputs, Mapping):
        return lambda model: model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return lambda model: model(*example_inputs)
    return lambda model: model(example_inputs)


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Undo what forwards do besides computing: buffer updates (batch-norm statistics) and
    draws from torch's generators (dropout)."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in buffers:
                        b.copy_(buffers[n])


def fit_budget(
    model: nn.Module,
    example_inputs: Any,
    budget: int | float | str,
    *,
    levels: Sequence[str] = ("L0", "L1", "L2", "L3"),
) -> MemoryPlan:
    """Choose each Q-layer's level so that a forward of ``example_inputs`` keeps at most
    ``budget`` bytes for backward, keeping as many layers as fine as the budget allows;
    set the levels on ``model`` and return the :class:`MemoryPlan`.

    ``model``: a model converted at the finest of ``levels`` (what no Q-layer saves is kept
    at the level it was converted at, so the finest end of the plan is that level
    throughout), or an unconverted one, which is converted so (in place). The Q-layers
    planned coarser run that level's fixed bits (adaptive bits stay off).
    ``example_inputs``: a tensor, a tuple of positional arguments, a dict of keyword
    arguments, or a callable ``forward(model)``; their shapes are the plan's (plan again for
    another batch or sequence length). ``budget``: bytes, or a string such as ``"6GiB"``.
    ``levels``: the candidate levels from finest to coarsest.

    Raises ValueError when even every Q-layer at the coarsest level keeps more than
    ``budget``, naming the smallest budget that fits.
    """
    budget_bytes = parse_bytes(budget)
    names, layers = _planned_layers(model, levels)
    forward = _forward_of(example_inputs)
    before = {n: m.act_spec for n, m in layers.items()}

    def kept(config: Mapping[str, str]) -> tuple[int, dict[str, int]]:
        return _measure(model, layers, forward, config)

    done = False
    try:
        with _preserved(model):
            plan = _search(kept, list(layers), names, budget_bytes)
        done = True
    finally:
        if not done:  # an error (or an infeasible budget): the levels as they were
            for n, m in layers.items():
                m.act_spec = before[n]
    plan.apply(model)
    return plan


def _planned_layers(model: nn.Module, levels: Sequence[str]) -> tuple[list[str], dict[str, QLayer]]:
    """The candidate level names (checked) and the Q-layers of ``model``, converted at the
    finest level first where it is not converted yet."""
    specs = [level_spec(level) for level in levels]  # ValueError naming an unknown level
    if not specs:
        raise ValueError("a memory plan needs at least one candidate level")
    names = [spec.name for spec in specs]
    report = getattr(model, "act_report", None)
    if report is None:
        convert(model, level=names[0])
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


def _measure(
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
    with track(model) as report:
        out = forward(model)
        settle(wait=True)  # CUDA: zero-value payloads at their exact size, as in training
    del out
    return report.retained_bytes, dict(report.by_module)


def default_budget(model: nn.Module) -> int:
    """The bytes a CUDA model's activations may take: the device's free memory, less the
    gradients its trainable parameters do not hold yet. Optimizer state counts only once it
    exists (after the first step), so plan after one step, or give the budget. ValueError
    for a model that is not on a CUDA device."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(
            f"the default budget is the free memory of the model's CUDA device, and this "
            f"model is on {device}: give a budget, such as budget='2GiB'"
        )
    free, _ = torch.cuda.mem_get_info(device)
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
) -> tuple[int, MemoryPlan]:
    """The largest batch whose activations fit ``budget`` at some plan, and that plan (set
    on ``model``, as :func:`fit_budget` sets it).

    ``make_inputs(batch)`` returns the example inputs of a batch of that size (a tensor, a
    tuple of positional arguments, a dict of keyword arguments, or a callable
    ``forward(model)``). A size fits when a forward of its inputs, every Q-layer at the
    coarsest of ``levels``, keeps at most ``budget`` bytes; sizes grow by doubling from
    ``start`` (default ``multiple_of``) until one does not fit (or ``limit``), then a
    bisection finds the last that does, in steps of ``multiple_of``. The plan for that size is :func:`fit_budget`'s: the
    finest levels that fit. ``budget``: bytes or a string such as ``"6GiB"``; ``None``,
    :func:`default_budget` (a CUDA model). What the budget bounds is what the forward keeps
    for backward, as :func:`fit_budget` measures it, not the step's transient peak.

    Raises ValueError when even ``start`` does not fit, naming what it keeps.
    """
    return _largest(model, make_inputs, budget, levels, start, limit, multiple_of, "batch")


def max_seq(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | float | str | None = None,
    *,
    levels: Sequence[str] = ("L0", "L1", "L2", "L3"),
    start: int | None = None,
    limit: int = 2**20,
    multiple_of: int = 1,
) -> tuple[int, MemoryPlan]:
    """:func:`max_batch` for a sequence length: ``make_inputs(length)`` returns the example
    inputs of that length (``multiple_of``: e.g. 64 for kernels that want aligned
    lengths)."""
    return _largest(model, make_inputs, budget, levels, start, limit, multiple_of, "sequence")


def _largest(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | float | str | None,
    levels: Sequence[str],
    start: int | None,
    limit: int,
    multiple_of: int,
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
    budget_bytes = default_budget(model) if budget is None else parse_bytes(budget)
    names, layers = _planned_layers(model, levels)
    coarsest = dict.fromkeys(layers, names[-1])
    before = {n: m.act_spec for n, m in layers.items()}
    measured: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in measured:
            measured[size] = _measure(model, layers, _forward_of(make_inputs(size)), coarsest)[0]
        return measured[size] <= budget_bytes

    try:
        with _preserved(model):
            if not fits(start):
                raise ValueError(
                    f"no {what} fits a budget of {format_bytes(budget_bytes)}: a {what} of "
                    f"{start} keeps {format_bytes(measured[start])} with every Q-layer at "
                    f"{names[-1]}"
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
    finally:
        for n, m in layers.items():
            m.act_spec = before[n]
    return good, fit_budget(model, make_inputs(good), budget_bytes, levels=names)


def _search(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    layers: list[str],
    names: list[str],
    budget: int,
) -> MemoryPlan:
    tables = [kept(dict.fromkeys(layers, name)) for name in names]
    exact, smallest = tables[0][0], tables[-1][0]
    if smallest > budget:
        raise ValueError(
            f"a budget of {format_bytes(budget)} cannot be met: with every Q-layer at "
            f"{names[-1]} a forward keeps {format_bytes(smallest)} ({smallest} bytes), the "
            f"smallest budget these levels fit; exact ({names[0]}) keeps {format_bytes(exact)}"
        )
    path = _path(layers, [t[1] for t in tables], names)
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
    config, used = _refine(
        kept, dict(path[lo]), measured[lo], [t[1] for t in tables], names, budget
    )
    return MemoryPlan(budget, config, used, exact, smallest)


def _refine(
    kept: Callable[[Mapping[str, str]], tuple[int, dict[str, int]]],
    config: dict[str, str],
    used: int,
    by_module: list[dict[str, int]],
    names: list[str],
    budget: int,
) -> tuple[dict[str, str], int]:
    """Spend what the path's step left of the budget: layers one level finer again, the
    cheapest first while the tables say they fit; then the longest run of those moves that
    fits when measured (a bisection)."""
    rank = {name: i for i, name in enumerate(names)}
    trial, moves, slack = dict(config), [], budget - used
    while True:
        best, best_cost = None, math.inf
        for layer, level in trial.items():
            i = rank[level]
            if i > 0:
                cost = by_module[i - 1].get(layer, 0) - by_module[i].get(layer, 0)
                if cost < best_cost:
                    best, best_cost = layer, cost
        if best is None or best_cost > slack:
            break
        trial[best] = names[rank[trial[best]] - 1]
        moves.append((best, trial[best]))
        slack -= best_cost

    def applied(k: int) -> dict[str, str]:
        out = dict(config)
        for layer, level in moves[:k]:
            out[layer] = level
        return out

    lo, hi, best_used = 0, len(moves), used  # moves[:lo] fit (measured)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        now = kept(applied(mid))[0]
        if now <= budget:
            lo, best_used = mid, now
        else:
            hi = mid - 1
    return applied(lo), best_used


def _path(
    layers: list[str], by_module: list[dict[str, int]], names: list[str]
) -> list[dict[str, str]]:
    """Configurations from all ``names[0]`` to all ``names[-1]``, one layer one level coarser
    per step, the move that saves the most bytes (by the uniform tables) first."""
    config = dict.fromkeys(layers, names[0])
    index = dict.fromkeys(layers, 0)
    path = [dict(config)]
    while True:
        best, best_saving = None, -math.inf
        for layer in layers:
            i = index[layer]
            if i + 1 < len(names):
                saving = by_module[i].get(layer, 0) - by_module[i + 1].get(layer, 0)
                if saving > best_saving:
                    best, best_saving = layer, saving
        if best is None:
            return path
        index[best] += 1
        config[best] = names[index[best]]
        path.append(dict(config))
