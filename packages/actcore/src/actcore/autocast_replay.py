"""Autocast state captured in a forward and re-entered where backward reruns part of it.

A backward that recomputes forward ops (attention rerun from its compressed q, k, v;
activations and norms recomputed from their input) must run them under the autocast the
forward ran them under: backward itself runs outside any autocast region, so without it
the rerun would see other dtypes than the forward did (as ``torch.utils.checkpoint`` does,
the state is recorded and re-entered).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["AutocastState", "autocast_state", "replayed_autocast"]

AutocastState = tuple[str, bool, torch.dtype, bool] | None


def autocast_state(device: torch.device) -> AutocastState:
    """The autocast in force for ``device`` now (None when off: nothing to re-enter)."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return kind, True, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled()
    except RuntimeError:  # a device type without autocast
        return None


@contextlib.contextmanager
def replayed_autocast(state: AutocastState) -> Iterator[None]:
    """Run the block under ``state`` (see :func:`autocast_state`); as it is when None."""
    if state is None:
        yield
        return
    kind, enabled, dtype, cache = state
    with torch.autocast(device_type=kind, dtype=dtype, enabled=enabled, cache_enabled=cache):
        yield
