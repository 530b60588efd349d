"""The policy interface (bits per saved tensor, by key) and :class:`FixedBits`."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from ..ops.api import check_bits

__all__ = ["FixedBits", "Policy", "check_iteration"]


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
