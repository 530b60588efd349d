"""What one forward under estimation records for the adaptive policies, per saved tensor.

What packs the saved tensors records into a :class:`PassStats` (the saved-tensor hooks of
:mod:`actcore.saved_tensors.hooks`; on the layer route a :class:`actcore.compressors.Tapped`
of :mod:`actcore.policy_scheme`); :class:`actcore.policies.AdaptivePolicy` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["PassStats", "record_stats"]


@dataclass
class PassStats:
    """What one forward under estimation recorded, per key (first save of each storage)."""

    bits: dict[str, int] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    # sum over groups of n_g * range_g^2 / 6: quantization variance at b bits is R/(2^b-1)^2
    spread: dict[str, Tensor] = field(default_factory=dict)

    def spreads(self) -> dict[str, float]:
        """``spread`` as floats (one device sync for all)."""
        if not self.spread:
            return {}
        keys = list(self.spread)
        values = torch.stack([self.spread[k].float().cpu() for k in keys]).tolist()
        return dict(zip(keys, values, strict=True))


def record_stats(
    stats: PassStats, key: str, bits: int, numel: int, tensors: Any, group_size: int
) -> None:
    """Record ``key``'s quantization spread from a :class:`Quantize` pack's tensors
    ``(payload, lo, step)`` (first record of a key wins; other packs are ignored)."""
    step = tensors[2] if len(tensors) == 3 else None
    if step is None or key in stats.bits:
        return
    levels = float(2**bits - 1)
    stats.bits[key] = bits
    stats.numel[key] = numel
    stats.spread[key] = step.float().square().sum() * (group_size * levels**2 / 6.0)
