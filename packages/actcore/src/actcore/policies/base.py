"""The policy interface (bits per saved tensor, by key) and :class:`FixedBits`."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from ..ops.api import check_bits

__all__ = ["FixedBits", "Policy", "check_iteration", "check_modules", "plan_modules"]


class Policy:
    """Decides the bits of each saved tensor, by key. ``None`` keeps a tensor uncompressed."""

    name = "policy"
    swap = False
    compresses = True
    adapt_interval = 0  # 0: never adapts

    def bits_for(self, key: str) -> int | None:
        raise NotImplementedError

    def wants_adapt(self, iteration: int) -> bool:
        return self.adapt_interval > 0 and iteration % self.adapt_interval == 0

    def adapt(self, packer: Any, backprop: Callable[[], Any]) -> None:
        """Re-estimate (adaptive policies); ``backprop`` runs forward and backward once."""

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"a policy state must be a dict, got {type(state).__name__}")
        if state.get("name", self.name) != self.name:
            raise ValueError(f"state of a {state.get('name')!r} policy given to {self.name!r}")


class FixedBits(Policy):
    """The same number of bits for every floating saved tensor; ``bits=None``: none."""

    name = "fixed"

    def __init__(self, bits: int | None, *, swap: bool = False) -> None:
        self.bits = None if bits is None else check_bits(bits)
        self.swap = bool(swap)
        self.compresses = bits is not None

    def bits_for(self, key: str) -> int | None:
        return self.bits

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bits": self.bits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        bits = state.get("bits", self.bits)
        if bits != self.bits:
            raise ValueError(
                f"state of FixedBits(bits={bits!r}) given to FixedBits(bits={self.bits})"
            )

    def __repr__(self) -> str:
        return f"FixedBits(bits={self.bits}, swap={self.swap})"


def check_iteration(value: Any, who: str) -> int:
    """An iteration count from a state: an int >= 0, else TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who} state iteration must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{who} state iteration must be >= 0, got {value}")
    return int(value)


def _module_of(key: str) -> str:
    """The module name a plan key starts with (``name:role``, ``name#call:index``)."""
    return key.split(":", 1)[0].split("#", 1)[0]


def _signature(module: Any) -> str:
    weight = getattr(module, "weight", None)
    known = isinstance(weight, torch.Tensor) and not torch.nn.parameter.is_lazy(weight)
    shape = list(weight.shape) if known else None
    return f"{type(module).__name__}{shape}" if shape is not None else type(module).__name__


def plan_modules(model: Any, policy_state: dict[str, Any]) -> dict[str, str]:
    """What a policy state's plan refers to: ``{module name: class and weight shape}`` for
    each module of ``model`` its keys name (saved beside the state, checked on load)."""
    plan = policy_state.get("plan")
    if model is None or not isinstance(plan, dict):
        return {}
    named = dict(model.named_modules(remove_duplicate=False))
    names = {_module_of(str(key)) for key in plan}
    return {name: _signature(named[name]) for name in sorted(names) if name in named}


def check_modules(model: Any, saved: Any, who: str) -> None:
    """ValueError unless the modules a saved plan refers to (:func:`plan_modules`) are those
    of ``model``: a plan taken on another model would assign its bits to the wrong tensors."""
    if model is None or saved is None:
        return
    if not isinstance(saved, dict):
        raise TypeError(f"{who} 'modules' must be a dict, got {saved!r}")
    named = dict(model.named_modules(remove_duplicate=False))
    differ = {
        name: (sig, _signature(named[name]) if name in named else "no such module")
        for name, sig in saved.items()
        if name not in named or _signature(named[name]) != sig
    }
    if differ:
        shown = dict(list(differ.items())[:5])
        raise ValueError(
            f"{who} was taken on another model than this {type(model).__name__}: modules "
            f"(saved, here) {shown}"
        )
