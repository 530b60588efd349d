"""What a backward that reruns part of the forward needs to run it as the forward did.

Attention reruns its kernel from the compressed q, k, v; recomputed activations and norms
rerun from their compressed input. Backward runs outside any autocast region, outside the
forward's RNG position and under whatever saved-tensor hooks are active, so the forward's
state is captured (:func:`forward_state`) and re-entered (:func:`replayed`), and the rerun's
own saves are plain (:func:`plain_saves`), as ``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["ForwardState", "forward_state", "plain_saves", "replayed"]


@dataclass(frozen=True)
class ForwardState:
    """``device``; ``rng``: (CPU state, CUDA state or None) when captured; ``autocast``:
    (device type, dtype, cache enabled) when autocast was on."""

    device: torch.device
    rng: tuple[torch.Tensor, torch.Tensor | None] | None
    autocast: tuple[str, torch.dtype, bool] | None


def forward_state(device: torch.device, rng: bool = False) -> ForwardState:
    """The state in force for ``device`` now (the RNG's only when ``rng``: a rerun that
    draws random numbers, such as attention dropout, must draw the same ones)."""
    rng_state = None
    if rng:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        rng_state = (torch.get_rng_state(), cuda)
    autocast = None
    try:
        if torch.is_autocast_enabled(device.type):
            kind = device.type
            autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
    except RuntimeError:  # a device type without autocast
        pass
    return ForwardState(device, rng_state, autocast)


@contextlib.contextmanager
def replayed(state: ForwardState) -> Iterator[None]:
    """Run the block under ``state``'s autocast and from its RNG state (the caller's RNG
    stream is left where it was)."""
    with contextlib.ExitStack() as stack:
        if state.rng is not None:
            cpu, cuda = state.rng
            devices = [state.device] if cuda is not None else []
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, state.device)
        if state.autocast is not None:
            kind, dtype, cache = state.autocast
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        yield


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def plain_saves() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep what the rerun saves as it is (an active scope's hooks
    would compress it again); its graph is used at once by ``autograd.grad``."""
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
