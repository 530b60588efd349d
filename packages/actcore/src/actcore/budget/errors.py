"""The gradient error each Q-layer adds at each level, measured by probe steps.

Stochastic rounding adds zero-mean noise, independent from layer to layer, so to first
order the squared error of the parameter gradient is a sum over layers: ``E||g - g0||^2
= sum_l e_l(level_l)``. One step with every Q-layer exact gives ``g0``; then, per coarser
level, the Q-layers are cut into at most :data:`GROUPS` runs in module order, and one
step with a run at that level (the rest exact) measures the run's share of the error,
split over its layers in proportion to what each keeps exact. All steps start from the
same seed (dropout draws alike) and back up from the output's loss where it has one, else
from a fixed random gradient of the output. ``1 + GROUPS * (levels - 1)`` steps in all.

The tables are kept per model and per shape of the example inputs (a callable's identity),
so planning the same model again for another budget costs no probe step; the bytes are
measured afresh every time (they decide what fits; the errors only order the moves).
:func:`forget_errors` drops a model's tables (to measure again after training changed it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..layers.base import QLayer
from .measured import forget, measured_once
from .peak import loss_for

__all__ = [
    "GROUPS",
    "cached_layer_errors",
    "cached_scope_errors",
    "forget_errors",
    "layer_errors",
    "scope_errors",
]

GROUPS = 8
"""Runs of Q-layers probed together per level (the cost: one step each)."""


def layer_errors(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    forward: Callable[[nn.Module], Any],
    names: Sequence[str],
    weights: Mapping[str, int],
) -> tuple[list[dict[str, float]], float]:
    """Per level in ``names`` (the first exact), each Q-layer's share of the squared
    gradient error, and the squared norm of the exact gradient. ``weights``: what each
    Q-layer keeps exact, the key by which a run's error is split. Leaves the Q-layers exact
    and each parameter's ``.grad`` as it was."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    order = list(layers)
    runs = _runs(order)
    try:
        exact = _gradients(model, layers, forward, {}, names[0], params)
        norm = sum(float(g.double().square().sum()) for g in exact if g is not None)
        tables = [dict.fromkeys(order, 0.0)]
        for level in names[1:]:
            table: dict[str, float] = {}
            for run in runs:
                grads = _gradients(
                    model, layers, forward, dict.fromkeys(run, level), names[0], params
                )
                table.update(_shared(_squared_distance(grads, exact), run, weights))
            tables.append(table)
    finally:
        for m in layers.values():
            m.act_level = names[0]
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
    return tables, norm


def scope_errors(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    forward: Callable[[nn.Module], Any],
    exact_level: str,
    units: Sequence[str],
    set_scope: Callable[[Sequence[str]], None],
    weights: Mapping[str, int],
) -> dict[str, float]:
    """Each scope unit's share of the squared gradient error when the model scope
    compresses inside it (``set_scope(units)`` switches it on in those units and keeps the
    rest exact), the Q-layers exact: runs of at most :data:`GROUPS` units probed one step
    each, a run's error split in proportion to ``weights`` (the bytes each unit saves).
    Leaves the scope exact everywhere and each parameter's ``.grad`` as it was."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    table: dict[str, float] = {}
    try:
        set_scope(())
        exact = _gradients(model, layers, forward, {}, exact_level, params)
        for run in _runs(list(units)):
            set_scope(run)
            grads = _gradients(model, layers, forward, {}, exact_level, params)
            table.update(_shared(_squared_distance(grads, exact), run, weights))
    finally:
        set_scope(())
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
    return table


def _runs(order: list[str]) -> list[list[str]]:
    """``order`` cut into at most :data:`GROUPS` consecutive runs (none empty)."""
    runs = [order[i * len(order) // GROUPS : (i + 1) * len(order) // GROUPS] for i in range(GROUPS)]
    return [run for run in runs if run]


def _shared(error: float, run: list[str], weights: Mapping[str, int]) -> dict[str, float]:
    """A run's ``error`` split over its members in proportion to ``weights`` (evenly where
    they are all zero)."""
    total = sum(weights.get(n, 0) for n in run)
    return {n: error * weights.get(n, 0) / total if total else error / len(run) for n in run}


def _squared_distance(grads: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> float:
    return sum(
        float((g.double() - g0.double()).square().sum())
        for g, g0 in zip(grads, exact, strict=True)
        if g is not None and g0 is not None
    )


def cached_layer_errors(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    example_inputs: Any,
    forward: Callable[[nn.Module], Any],
    names: Sequence[str],
    weights: Mapping[str, int],
) -> tuple[list[dict[str, float]], float]:
    """:func:`layer_errors`, measured once per model, candidate levels, Q-layers and shape
    of ``example_inputs`` (:mod:`.measured`)."""
    return measured_once(
        "errors",
        model,
        example_inputs,
        (tuple(names), tuple(layers)),
        lambda: layer_errors(model, layers, forward, names, weights),
    )


def cached_scope_errors(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    example_inputs: Any,
    forward: Callable[[nn.Module], Any],
    exact_level: str,
    units: Sequence[str],
    set_scope: Callable[[Sequence[str]], None],
    weights: Mapping[str, int],
    variant: str = "scope",
) -> dict[str, float]:
    """:func:`scope_errors`, measured once per model, Q-layers, units, ``variant`` (what
    ``set_scope`` sets besides the scope: ``"recomputed"``, every block recomputed) and
    shape of ``example_inputs`` (:mod:`.measured`)."""
    return measured_once(
        "errors",
        model,
        example_inputs,
        (variant, exact_level, tuple(layers), tuple(units)),
        lambda: scope_errors(model, layers, forward, exact_level, units, set_scope, weights),
    )


def forget_errors(model: nn.Module) -> None:
    """Drop the error tables kept for ``model``: the next plan measures them again."""
    forget("errors", model)


def _gradients(
    model: nn.Module,
    layers: Mapping[str, QLayer],
    forward: Callable[[nn.Module], Any],
    config: Mapping[str, str],
    exact: str,
    params: list[nn.Parameter],
) -> list[torch.Tensor | None]:
    for n, m in layers.items():
        m.act_level = config.get(n, exact)
    for p in params:
        p.grad = None
    torch.manual_seed(0)
    output = forward(model)
    loss = loss_for(output, "planning by gradient error")
    if loss.dim() == 0:
        loss.backward()
    else:
        direction = torch.randn(
            loss.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32
        )
        loss.backward(direction.to(device=loss.device, dtype=loss.dtype))
    del output, loss
    return [None if p.grad is None else p.grad.detach().clone() for p in params]
