"""Checking a saved :class:`~actcore.adaptive.AdaptiveBits` state before any of it is used.

:func:`checked_state` reads and checks every value of a state (types, ranges, the plans
against the statistics), so that ``load_state_dict``, and a resume that only checks, change
nothing on a bad one: a ValueError, TypeError or KeyError names what is wrong.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .stats import LayerStats

__all__: list[str] = []  # private to actcore.adaptive

DEFAULT_WINDOW = 4  # AdaptiveBits' window (and that of states saved before it had one)
STATE_FIELDS = (
    "budget",
    "interval",
    "window",
    "momentum",
    "min_bits",
    "max_bits",
    "steps",
    "num_samples",
    "sample_momentum",
    "skipped",
)
"""The scheme's own values a state holds beside its layers, in :func:`checked_state`'s order."""


def layer_state(st: LayerStats) -> dict[str, Any]:
    """One layer's statistics and plan as a state entry (:func:`checked_state` reads it)."""
    return {
        "sens": st.sens,
        "profile": st.profile,
        "elems": st.elems,
        "zero_value": st.zero_value,
        "norm": st.norm,
        "plan": torch.tensor(st.plan, dtype=torch.int8),
        "grads": st.grads,
        "sens_seen": st.sens_seen,
        "profile_seen": st.profile_seen,
        "readers": sorted(st.readers),
    }


def _number(state: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    if key not in state:
        if default is not None:
            return default
        raise KeyError(f"AdaptiveBits state lacks {key!r}")
    value = state[key]
    ok = isinstance(value, numbers.Integral if kind is int else numbers.Real)
    if not ok or isinstance(value, bool):
        raise TypeError(f"AdaptiveBits state {key!r} must be a {kind.__name__}, got {value!r}")
    return kind(value)


def _tensor(entry: dict[str, Any], key: str, name: str, dim: int | None) -> torch.Tensor | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"layer {name!r}: {key} must be a tensor or None, got {value!r}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"layer {name!r}: {key} must be {dim}-D, got shape {tuple(value.shape)}")
    return value


def checked_state(state: Any) -> tuple[tuple, dict[str, LayerStats]]:
    """The values of an AdaptiveBits state (those of :data:`STATE_FIELDS`, then the layers'),
    checked; ValueError/TypeError/KeyError if bad."""
    if not isinstance(state, dict):
        raise TypeError(f"AdaptiveBits state must be a dict, got {type(state).__name__}")
    budget = _number(state, "budget", float)
    min_bits, max_bits = _number(state, "min_bits", int), _number(state, "max_bits", int)
    if not 1 <= min_bits <= budget <= max_bits <= 8:
        raise ValueError(
            "AdaptiveBits state needs 1 <= min_bits <= budget <= max_bits <= 8, got "
            f"{min_bits}, {budget}, {max_bits}"
        )
    interval = _number(state, "interval", int)
    if interval < 1:
        raise ValueError(f"AdaptiveBits state interval must be a positive int, got {interval}")
    window = _number(state, "window", int, DEFAULT_WINDOW)
    if window < 1:
        raise ValueError(f"AdaptiveBits state window must be a positive int, got {window}")
    momentum = _number(state, "momentum", float)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"AdaptiveBits state momentum must be in [0, 1), got {momentum}")
    steps = _number(state, "steps", int)
    if steps < 0:
        raise ValueError(f"AdaptiveBits state steps must be >= 0, got {steps}")
    num_samples = state.get("num_samples")
    if num_samples is not None:
        num_samples = _number(state, "num_samples", int)
        if num_samples < 1:
            raise ValueError(f"AdaptiveBits state num_samples must be >= 1, got {num_samples}")
    sample_momentum = _number(state, "sample_momentum", float, 0.0)
    if not 0.0 <= sample_momentum < 1.0:
        raise ValueError(
            f"AdaptiveBits state sample_momentum must be in [0, 1), got {sample_momentum}"
        )
    skipped = _number(state, "skipped", int, 0)
    if skipped < 0:
        raise ValueError(f"AdaptiveBits state skipped must be >= 0, got {skipped}")
    entries = state.get("layers")
    if not isinstance(entries, dict):
        raise TypeError(f"AdaptiveBits state 'layers' must be a dict, got {type(entries).__name__}")
    layers = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise TypeError(f"layer {name!r}: entry must be a dict, got {type(entry).__name__}")
        layers[name] = _checked_layer(str(name), entry, min_bits, max_bits)
    top = (budget, interval, window, momentum, min_bits, max_bits, steps, num_samples)
    return (*top, sample_momentum, skipped), layers  # in STATE_FIELDS' order


def _checked_layer(name: str, entry: dict[str, Any], min_bits: int, max_bits: int) -> LayerStats:
    sens = _tensor(entry, "sens", name, 0)
    profile = _tensor(entry, "profile", name, 1)
    elems = _tensor(entry, "elems", name, 0)
    for key, t in (("sens", sens), ("profile", profile), ("elems", elems)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer {name!r}: {key} holds non-finite values")
    zero_value, norm = entry.get("zero_value", False), entry.get("norm", False)
    for key, flag in (("zero_value", zero_value), ("norm", norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"layer {name!r}: {key} must be a bool, got {flag!r}")
    raw_plan = entry.get("plan", [])
    if isinstance(raw_plan, torch.Tensor):
        if raw_plan.dim() != 1 or raw_plan.is_floating_point():
            raise ValueError(f"layer {name!r}: plan must be a 1-D integer tensor")
        raw_plan = raw_plan.tolist()
    if not isinstance(raw_plan, (list, tuple)) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in raw_plan
    ):
        raise TypeError(f"layer {name!r}: plan must hold ints, got {raw_plan!r}")
    plan = [int(b) for b in raw_plan]
    bad = [b for b in plan if not min_bits <= b <= max_bits]
    if bad:
        raise ValueError(
            f"layer {name!r}: plan bits {bad} outside min_bits..max_bits = {min_bits}..{max_bits}"
        )
    if plan != sorted(plan, reverse=True):
        raise ValueError(f"layer {name!r}: plan must give bits by rank, largest first: {plan}")
    if plan and profile is not None:
        expected = 1 if zero_value else profile.shape[0]
        if len(plan) != expected:
            raise ValueError(
                f"layer {name!r}: plan has {len(plan)} entries, its statistics need {expected}"
            )
    grads = _tensor(entry, "grads", name, 1)
    if grads is not None and (not grads.is_floating_point() or bool(grads.isinf().any())):
        raise ValueError(f"layer {name!r}: grads must be finite floats (NaN: sample unseen)")
    readers = entry.get("readers", [])
    if not isinstance(readers, (list, tuple, set)) or not all(isinstance(r, str) for r in readers):
        raise TypeError(f"layer {name!r}: readers must be layer names, got {readers!r}")
    seen = {}
    for key in ("sens_seen", "profile_seen"):
        t = _tensor(entry, key, name, 0)
        if t is not None and (t.is_floating_point() or int(t) < 0):
            raise ValueError(f"layer {name!r}: {key} must be a count >= 0")
        seen[key] = t
    return LayerStats(
        sens=sens,
        profile=profile,
        elems=elems,
        zero_value=zero_value,
        plan=plan,
        norm=norm,
        grads=grads,
        readers=set(readers),
        **seen,
    )


def check_same_layers(
    state: dict[str, Any],
    layers: dict[str, LayerStats],
    weights: dict[str, tuple[int, ...] | None],
) -> None:
    """ValueError unless ``state`` was taken on the layers this scheme is attached to
    (``weights``: name -> weight shape, None while lazy; nothing to compare before
    attaching): the same names, and the same weight shapes where both are known."""
    if not weights:
        return
    unknown = sorted(set(layers) - set(weights))
    missing = sorted(set(weights) - set(layers))
    if unknown or missing:
        raise ValueError(
            "AdaptiveBits state was taken on other layers than this model's: "
            f"layers not in the model {unknown}, layers of the model not in the state {missing}"
        )
    saved = state.get("weights")
    if saved is None:  # a state from before weight shapes were recorded
        return
    if not isinstance(saved, dict):
        raise TypeError(f"AdaptiveBits state 'weights' must be a dict, got {saved!r}")
    differ = {
        name: (list(saved[name]), list(shape))
        for name, shape in weights.items()
        if shape is not None and saved.get(name) is not None and list(saved[name]) != list(shape)
    }
    if differ:
        raise ValueError(
            "AdaptiveBits state was taken on other layers than this model's (weight shapes "
            f"saved vs here): {differ}"
        )
