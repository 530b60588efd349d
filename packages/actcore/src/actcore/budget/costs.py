"""What each choice of a memory plan adds to a training step's time, measured on the machine.

Whole steps (forward and backward) are timed with every Q-layer at each candidate level,
and with every candidate block recomputed (the Q-layers exact), in ``rounds`` rounds that
take the configurations in turn (so a drift of the machine's speed falls on all alike),
after one untimed step each. During the same steps forward hooks time each Q-layer's and
each block's forward. A step's extra time at a level is split over the Q-layers in
proportion to how much longer each one's forward took there (its packing: unpacking in
backward follows the packing's size); recompute's, over the blocks in proportion to their
exact forwards (what backward runs again); the model scope's, measured with it
compressing in the rest of the model alone and then in the blocks alone, over the blocks
by how much longer their forwards took; and recompute with
the scope on in the blocks (each block's input packed) over the blocks by how much longer
their forwards took than with recompute alone. Each configuration's extra time is the
median over the rounds of its step less the exact step of the same round, so a drift of
the machine between rounds cancels. No packing's share is less than what it added to its
forward, so on a noisy machine a step measured faster than that counts as that. A
recompute's share has no such floor: its block's checkpointed forward saves nothing,
which can make up for much of running it again (on a 2-core CPU, recomputing the Llama
4x512's four decoder layers added 9-24% to a step in which their forwards took about 30%).
The model is additive: ``step(config) = exact + sum(layer[level of l][l]) + sum(block[b]
for b recomputed, or packed[b] where its scope is on) + sum(scope[u] for u compressing,
not recomputed)``; with every Q-layer at one level, or every block recomputed, it gives the
exact step plus that configuration's measured extra (or, for a level, the layers' longer
forwards where they add up to more).

On CUDA the hooks record events and each step ends with a synchronisation; elsewhere they
read ``time.perf_counter``. The times are kept per model, candidate levels, Q-layers,
blocks and shape of the example inputs, as the gradient errors are (:mod:`.errors`);
:func:`forget_times` drops them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .checkpointing import set_recompute
from .measured import forget, measured_once
from .peak import loss_for

__all__ = ["StepTimes", "cached_step_times", "forget_times", "step_times"]

ROUNDS = 3
"""Timed steps per configuration (the median counts), after one untimed step each."""


@dataclass(frozen=True)
class StepTimes:
    """Seconds of a training step, and what each choice adds to it (see the module
    docstring)."""

    exact: float  # a step with every Q-layer at the finest level, nothing recomputed
    layer: list[dict[str, float]]  # per candidate level: Q-layer -> seconds it adds
    block: dict[str, float]  # block -> seconds recomputing it adds
    uniform: list[float]  # the measured steps with every Q-layer at each level
    recomputed: float | None  # the measured step with every block recomputed
    scope: dict[str, float] = field(default_factory=dict)  # unit -> seconds its scope adds
    scoped: float | None = None  # the step with the scope on in every unit (measured in two)
    packed: dict[str, float] = field(default_factory=dict)  # block -> seconds recomputing it
    # adds with its scope on (its input packed): recompute and the packing
    recomputed_packed: float | None = None  # the step with every such block so

    def predict(
        self, levels: Mapping[str, int], recompute: Sequence[str], scope: Sequence[str] = ()
    ) -> float:
        """The step's seconds with each Q-layer at ``levels``' candidate index,
        ``recompute``'s blocks recomputed and the model scope compressing in ``scope``'s
        units (a recomputed block whose scope is on: its input packed)."""
        on = set(scope)
        return (
            self.exact
            + sum(self.layer[i].get(n, 0.0) for n, i in levels.items())
            + sum(
                self.packed.get(b, 0.0) if b in on and b in self.packed else self.block.get(b, 0.0)
                for b in recompute
            )
            + sum(self.scope.get(u, 0.0) for u in on if u not in recompute)
        )


def step_times(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    forward: Callable[[nn.Module], Any],
    names: Sequence[str],
    blocks: Sequence[str],
    rounds: int = ROUNDS,
    units: Sequence[str] = (),
    set_scope: Callable[[Sequence[str]], None] | None = None,
) -> StepTimes:
    """Measure :class:`StepTimes` (see the module docstring). ``units``: the modules in
    which the model scope can compress or keep exact (``set_scope(on)`` switches it on in
    those of ``on``, exact in the others), ``""`` for what no other unit holds: two more
    configurations, the scope on in ``""`` alone (its extra time is that unit's), and on in
    every other unit (its extra time split over them by how much longer their forwards
    took); with ``blocks`` among the units, one more: every block recomputed with its
    scope on (its input packed). A packing's share is at least what it added to its
    forward. Leaves the Q-layers at ``names[0]``, no block recomputed, the scope exact,
    and each parameter's ``.grad`` as it was."""
    units = list(units) if set_scope is not None else []
    watched = {
        **layers,
        **{b: model.get_submodule(b) for b in blocks},
        **{u: model.get_submodule(u) for u in units},
    }
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    clock = _Clock(next((p.device for p in params), torch.device("cpu")))
    timer = _ForwardTimer(watched, clock)
    # (level, every block recomputed, the scope's units on: none, "" alone, or the others)
    configs: list[tuple[str, bool, str]] = [(level, False, "") for level in names]
    if blocks:
        configs.append((names[0], True, ""))
    inner = [u for u in units if u != ""]
    packable = [b for b in blocks if b in inner]  # recomputed with its input packed
    if units:
        configs.append((names[0], False, "rest"))
        if inner:
            configs.append((names[0], False, "blocks"))
    if packable:
        configs.append((names[0], True, "blocks"))
    steps: dict[tuple[str, bool, str], list[float]] = {c: [] for c in configs}
    forwards: dict[tuple[str, bool, str], list[dict[str, float]]] = {c: [] for c in configs}

    def set_config(level: str, recompute: bool, scope: str) -> None:
        for m in layers.values():
            m.act_level = level
        for b in blocks:
            set_recompute(model.get_submodule(b), recompute)
        if set_scope is not None:
            set_scope([""] if scope == "rest" else inner if scope == "blocks" else [])

    try:
        for timed in [False] + [True] * max(1, rounds):
            for config in configs:
                set_config(*config)
                for p in params:
                    p.grad = None
                torch.manual_seed(0)
                seconds, by_module = _step(model, forward, clock, timer)
                if timed:
                    steps[config].append(seconds)
                    forwards[config].append(by_module)
    finally:
        timer.remove()
        set_config(names[0], False, "")
        for p, grad in zip(params, held, strict=True):
            p.grad = grad

    def medians(config: tuple[str, bool, str]) -> dict[str, float]:
        runs = forwards[config]
        return {n: statistics.median(r.get(n, 0.0) for r in runs) for n in watched}

    def extra(config: tuple[str, bool, str], base: tuple[str, bool, str]) -> float:
        """What ``config``'s step takes beyond ``base``'s: the median over the rounds of
        the difference within each round (a drift between rounds cancels)."""
        return statistics.median(a - b for a, b in zip(steps[config], steps[base], strict=True))

    first = (names[0], False, "")
    uniform = [statistics.median(steps[(level, False, "")]) for level in names]
    exact, exact_fwd = uniform[0], medians(first)
    layer = [dict.fromkeys(layers, 0.0)]
    for level in names[1:]:
        fwd = medians((level, False, ""))
        longer = {n: max(0.0, fwd[n] - exact_fwd[n]) for n in layers}
        layer.append(_split(extra((level, False, ""), first), longer))
    block: dict[str, float] = {}
    recomputed = None
    if blocks:
        recomputed = statistics.median(steps[(names[0], True, "")])
        weights = {b: exact_fwd[b] for b in blocks}  # no floor: the checkpointed forward
        block = _split(extra((names[0], True, ""), first), weights, floor=False)  # saves
    scope: dict[str, float] = {}  # nothing, which can make up for much of a recompute
    scoped = None
    if units:
        if "" in units:
            fwd = medians((names[0], False, "rest"))
            scope[""] = max(0.0, extra((names[0], False, "rest"), first), fwd[""] - exact_fwd[""])
        scoped = exact + scope.get("", 0.0)
        if inner:
            fwd = medians((names[0], False, "blocks"))
            longer = {u: max(0.0, fwd[u] - exact_fwd[u]) for u in inner}
            scope.update(_split(extra((names[0], False, "blocks"), first), longer))
            scoped += sum(scope[u] for u in inner)
    packed: dict[str, float] = {}
    recomputed_packed = None
    if packable and recomputed is not None:
        recomputed_packed = statistics.median(steps[(names[0], True, "blocks")])
        fwd, plain = medians((names[0], True, "blocks")), medians((names[0], True, ""))
        longer = {b: max(0.0, fwd[b] - plain[b]) for b in packable}
        more = _split(extra((names[0], True, "blocks"), (names[0], True, "")), longer)
        packed = {b: block[b] + more[b] for b in packable}
    return StepTimes(
        exact, layer, block, uniform, recomputed, scope, scoped, packed, recomputed_packed
    )


def _split(extra: float, weights: Mapping[str, float], floor: bool = True) -> dict[str, float]:
    """``extra`` seconds (at least 0) split in proportion to ``weights`` (evenly where they
    are all zero); with ``floor``, each share at least its own weight where the step's
    extra measured less (the forwards' extra seconds: a packing takes at least what it
    added to its forward, within the noise)."""
    total = sum(weights.values())
    extra = max(0.0, extra, total if floor else 0.0)
    if total <= 0:
        return {n: extra / len(weights) for n in weights} if weights else {}
    return {n: extra * w / total for n, w in weights.items()}


def cached_step_times(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    example_inputs: Any,
    forward: Callable[[nn.Module], Any],
    names: Sequence[str],
    blocks: Sequence[str],
    units: Sequence[str] = (),
    set_scope: Callable[[Sequence[str]], None] | None = None,
) -> StepTimes:
    """:func:`step_times`, measured once per model, candidate levels, Q-layers, blocks,
    scope units and shape of ``example_inputs`` (:mod:`.measured`)."""
    return measured_once(
        "times",
        model,
        example_inputs,
        (tuple(names), tuple(layers), tuple(blocks), tuple(units)),
        lambda: step_times(model, layers, forward, names, blocks, units=units, set_scope=set_scope),
    )


def forget_times(model: nn.Module) -> None:
    """Drop the step times kept for ``model``: the next plan measures them again."""
    forget("times", model)


class _Clock:
    """Marks in time: ``perf_counter`` readings, or CUDA events (read after a sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class _ForwardTimer:
    """Forward hooks that time each watched module's forwards while ``on`` (a module called
    twice in a forward counts both calls)."""

    def __init__(self, modules: Mapping[str, nn.Module], clock: _Clock) -> None:
        self.clock = clock
        self.on = False
        self.spans: list[tuple[str, Any, Any]] = []
        self._open: dict[str, list[Any]] = {}
        self._handles = []
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.on:
                self._open.setdefault(name, []).append(self.clock.mark())

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            started = self._open.get(name)
            if self.on and started:
                self.spans.append((name, started.pop(), self.clock.mark()))

        return hook

    def take(self) -> dict[str, float]:
        """Seconds per module over the spans recorded since the last call."""
        out: dict[str, float] = {}
        for name, start, end in self.spans:
            out[name] = out.get(name, 0.0) + self.clock.seconds(start, end)
        self.spans.clear()
        self._open.clear()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _step(
    model: nn.Module, forward: Callable[[nn.Module], Any], clock: _Clock, timer: _ForwardTimer
) -> tuple[float, dict[str, float]]:
    clock.sync()
    start = clock.mark()
    timer.on = True
    try:
        output = forward(model)
    finally:
        timer.on = False
    loss = loss_for(output, "timing a memory plan's choices")
    loss.backward(torch.ones_like(loss))
    del output, loss
    end = clock.mark()
    clock.sync()
    return clock.seconds(start, end), timer.take()
