"""What a converted model needs, beyond its own ``state_dict``, to resume bit for bit.

::

    torch.save({"model": model.state_dict(), "act": actcore.resume.state_dict(model)}, path)
    ...
    model = actcore.convert(build(), level="L3")
    model.load_state_dict(ckpt["model"])
    actcore.resume.load_state_dict(model, ckpt["act"])

The state holds the model's stream of rounding seeds (``act_rng``), its adaptive-bits plan
and statistics (``act_adaptive``, levels L3 and up), its policy (``act_policy``) and the
memory plan :func:`actcore.fit_budget` set (``act_memory_plan``: each Q-layer's level) and
the Q-layers' kept channel scales (``channel_scales``), where present. Loading checks every
part before changing any. (The hooks route: a :class:`actcore.Controller`'s own
``state_dict`` holds the same.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .adaptive import AdaptiveBits
from .budget import MemoryPlan
from .compressors.channel_scaled import ChannelScales
from .rng import SeedStream

__all__ = ["load_state_dict", "state_dict"]


def state_dict(model: nn.Module) -> dict[str, Any]:
    """The ACT state of a converted ``model`` (parts it lacks are left out)."""
    state: dict[str, Any] = {}
    stream = model.__dict__.get("act_rng")
    if isinstance(stream, SeedStream):
        state["rng"] = stream.state_dict()
    adaptive = getattr(model, "act_adaptive", None)
    if isinstance(adaptive, AdaptiveBits):
        state["adaptive"] = adaptive.state_dict()
    policy = getattr(model, "act_policy", None)
    if policy is not None:
        state["policy"] = policy.state_dict()
    plan = model.__dict__.get("act_memory_plan")
    if isinstance(plan, MemoryPlan):
        state["memory_plan"] = plan.state_dict()
    scales = _layer_scales(model)
    if scales:
        state["channel_scales"] = {
            name: {f"{role}/{dim}": s.state_dict() for (role, dim), s in table.items()}
            for name, table in scales.items()
        }
    return state


def _layer_scales(model: nn.Module) -> dict[str, dict]:
    """Each Q-layer's kept channel scales (``act_channel_scales``), by module name."""
    found = {}
    for name, module in model.named_modules():
        table = module.__dict__.get("act_channel_scales")
        if table:
            found[name] = table
    return found


def _scales_from_state(model: nn.Module, state: Any) -> dict[str, dict]:
    """The ``channel_scales`` part, checked: module name -> {(role, dim): ChannelScales}."""
    if not isinstance(state, dict):
        raise TypeError(f"channel_scales must be a dict, got {type(state).__name__}")
    names = dict(model.named_modules())
    tables = {}
    for name, table in state.items():
        if name not in names:
            raise KeyError(f"channel_scales names module {name!r}, which this model lacks")
        if not isinstance(table, dict):
            raise TypeError(f"channel_scales[{name!r}] must be a dict")
        entries = {}
        for key, value in table.items():
            role, sep, dim = str(key).rpartition("/")
            if not sep or not dim.isdigit():
                raise ValueError(f"channel_scales[{name!r}]: bad key {key!r} (ROLE/DIM)")
            entries[role, int(dim)] = ChannelScales.from_state_dict(value)
        tables[name] = entries
    return tables


def load_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Load :func:`state_dict`'s output into a model converted the same way."""
    if not isinstance(state, dict):
        raise TypeError(f"an ACT state must be a dict, got {type(state).__name__}")
    parts = {
        "rng": model.__dict__.get("act_rng"),
        "adaptive": getattr(model, "act_adaptive", None),
        "policy": getattr(model, "act_policy", None),
        "memory_plan": model,  # any converted model can take a plan of its Q-layers' levels
        "channel_scales": model,  # its Q-layers' kept scales
    }
    for key in state:
        if key not in parts:
            raise KeyError(f"unknown part {key!r} of an ACT state; known: {', '.join(parts)}")
        if parts[key] is None:
            raise ValueError(
                f"the ACT state has a {key!r} part but this model has none: convert it at the "
                "level (and policy) the state was saved from"
            )
    if "rng" in state:
        SeedStream(0).load_state_dict(state["rng"])  # check only
    if "adaptive" in state:
        parts["adaptive"].check_state(state["adaptive"])  # check only
    plan = MemoryPlan.from_state_dict(state["memory_plan"]) if "memory_plan" in state else None
    if plan is not None:
        plan.check(model)  # check only
    scales = (
        _scales_from_state(model, state["channel_scales"]) if "channel_scales" in state else None
    )
    if "policy" in state:
        parts["policy"].load_state_dict(state["policy"])  # checks all, then changes
    if plan is not None:
        plan.apply(model)
    if "adaptive" in state:
        parts["adaptive"].load_state_dict(state["adaptive"])
    if "rng" in state:
        parts["rng"].load_state_dict(state["rng"])
    if scales is not None:
        modules = dict(model.named_modules())
        for name, table in scales.items():
            object.__setattr__(modules[name], "act_channel_scales", table)
