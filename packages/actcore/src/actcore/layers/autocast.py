"""Autocast for the Q-layers: cast inputs as torch's autocast casts them for the torch
layer's own op, so a Q-layer computes in the dtype its torch layer would."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "LOWER_PRECISION",
    "autocast_cast",
    "autocast_inputs",
]

LOWER_PRECISION = "lower"  # conv / linear: autocast's lower-precision list on every device
_PROBES: dict[str, Any] = {
    "batch_norm": lambda t: nn.functional.batch_norm(t, None, None, training=True),
    "layer_norm": lambda t: nn.functional.layer_norm(t, t.shape[-1:]),
    "group_norm": lambda t: nn.functional.group_norm(t, 1),
    "avg_pool1d": lambda t: nn.functional.avg_pool1d(t[:, :, 0, 0], 1),
    "avg_pool2d": lambda t: nn.functional.avg_pool2d(t[:, :, 0], 1),
    "avg_pool3d": lambda t: nn.functional.avg_pool3d(t, 1),
}
_autocast_targets: dict[tuple, torch.dtype | None] = {}


def _autocast_target(op: str, device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs ``op`` in on ``device`` now (None: it leaves inputs alone).

    Conv and linear are autocast's lower-precision ops everywhere; for the others the
    policy differs by device (e.g. layer_norm runs in fp32 on CUDA, as is on CPU), so it
    is read off torch once: the op is run on a tiny tensor of a third floating dtype.
    """
    low = torch.get_autocast_dtype(device.type)
    if op == LOWER_PRECISION:
        return low
    key = (op, device.type, low)
    if key not in _autocast_targets:
        probe_dtype = torch.float16 if low == torch.bfloat16 else torch.bfloat16
        try:
            with torch.no_grad():
                probe = torch.ones(2, 2, 1, 1, 1, dtype=probe_dtype, device=device)
                got = _PROBES[op](probe).dtype
        except RuntimeError:  # no kernel for the probe dtype: assume it runs as it is
            got = probe_dtype
        _autocast_targets[key] = got if got in (low, torch.float32) else None
    return _autocast_targets[key]


def autocast_cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Autocast's rule: floating tensors other than float64 go to ``dtype``, others stay."""
    eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
    return t.to(dtype) if eligible else t


def autocast_inputs(op: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` cast as autocast casts the inputs of torch's ``op`` (unchanged when off)."""
    x = tensors[0]
    if not torch.is_autocast_enabled(x.device.type):
        return tensors
    target = _autocast_target(op, x.device)
    if target is None:
        return tensors
    return tuple(autocast_cast(t, target) for t in tensors)
