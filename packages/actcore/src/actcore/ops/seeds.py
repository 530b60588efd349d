"""Seeds of stochastic rounding: :func:`new_seed`, and the ``actcore::rounding_noise``
operator that gives a compiled graph fresh noise at run time."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .library import hash_uniform
from .noise import MASK32, SEED_LIMIT, mix32

__all__ = ["new_seed", "reset_seed_stream", "rounding_noise"]

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


@torch.library.custom_op("actcore::rounding_noise", mutates_args=())
def rounding_noise(anchor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Uniform [0, 1) float32 noise of ``shape`` on ``anchor``'s device: the counter hash of
    :mod:`actcore.ops.noise` (native kernels where built) under a fresh :func:`new_seed`,
    drawn when the op runs. A compiled graph that calls it gets new rounding noise on every
    call, with no seed baked into the graph and without drawing from torch's generators (so
    dropout and other random ops see the stream they would see without actcore)."""
    numel = math.prod(shape)
    index = torch.arange(numel, device=anchor.device).view(tuple(shape))
    return hash_uniform(index, new_seed())


@rounding_noise.register_fake
def _(anchor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return anchor.new_empty(tuple(shape), dtype=torch.float32)
