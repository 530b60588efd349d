"""Seeds of stochastic rounding: :func:`new_seed`, and the ``actcore::quantize_fresh``
operator that rounds with a seed drawn at run time (for compiled graphs)."""

from __future__ import annotations

import torch

from .library import quantize, quantize_fake
from .noise import MASK32, SEED_LIMIT, mix32

__all__ = ["new_seed", "quantize_fresh", "reset_seed_stream"]

_seed_state = {"base": None, "count": 0}


def new_seed() -> int:
    """A fresh seed, without drawing from (and so without perturbing) torch's generators.

    Inside a converted model's (or a Controller's) forward, the next seed of that model's own
    :class:`actcore.rng.SeedStream`. Elsewhere, seeds follow a per-process counter keyed by
    ``torch.initial_seed()``: a process that calls ``torch.manual_seed(s)`` gets the same
    sequence each run, and a new seed value restarts it. :func:`reset_seed_stream` restarts
    it in-process. No device sync.
    """
    from ..rng import current

    stream = current()
    if stream is not None:
        return stream.next_seed()
    base = torch.initial_seed()
    if base != _seed_state["base"]:
        _seed_state["base"], _seed_state["count"] = base, 0
    _seed_state["count"] += 1
    return (mix32(base & MASK32) << 31 ^ mix32(_seed_state["count"] & MASK32) ^ base) % SEED_LIMIT


def reset_seed_stream() -> None:
    """Restart the sequence of :func:`new_seed` (e.g. to repeat a run in one process)."""
    _seed_state["base"], _seed_state["count"] = None, 0


@torch.library.custom_op("actcore::quantize_fresh", mutates_args=())
def quantize_fresh(
    x: torch.Tensor, bits: int, group_size: int, per_sample: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``actcore::quantize`` with stochastic rounding under a fresh :func:`new_seed`, drawn
    when the op runs: a compiled graph that calls it rounds with new noise on every call,
    with no seed baked into the graph and without drawing from torch's generators (so
    dropout and other random ops see the stream they would see without actcore). Returns
    ``(payload, lo, step)`` as ``quantize`` does; ``dequantize`` inverts it."""
    return quantize(x, bits, group_size, True, new_seed(), per_sample)


@quantize_fresh.register_fake
def _(x: torch.Tensor, bits: int, group_size: int, per_sample: bool) -> tuple[torch.Tensor, ...]:
    return quantize_fake(x, bits, group_size, True, 0, per_sample)
