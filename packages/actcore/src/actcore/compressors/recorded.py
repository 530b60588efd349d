"""``Recorded``: packs with an inner compressor and records its spread for an estimate.

The layer route's :class:`actcore.policy_scheme.PolicyScheme` wraps its compressors in it
while an adaptive policy estimates sensitivities (the saved-tensor hooks record the same
statistics themselves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..saved_tensors.pass_stats import record_stats
from .base import Compressor, Wrapping

__all__ = ["Recorded"]


@dataclass(frozen=True, eq=False)
class Recorded(Wrapping):
    """Packs with ``inner`` and records its spread in ``recorder.stats`` under ``stat_key``.

    ``recorder``: what holds the estimate's :class:`actcore.saved_tensors.pass_stats.PassStats`
    (``.stats``, None outside an estimate) and the quantization ``.group_size``.
    """

    inner: Compressor
    stat_key: str
    bits: int
    recorder: Any
    name = "recorded"

    def pack(self, x: Any) -> tuple[Any, Any]:
        tensors, meta = self.inner.pack(x)
        stats = self.recorder.stats
        if stats is not None:
            record_stats(
                stats, self.stat_key, self.bits, x.numel(), tensors, self.recorder.group_size
            )
        return tensors, meta

    def unpack(self, tensors: Any, meta: Any) -> Any:
        return self.inner.unpack(tensors, meta)

    def key(self) -> tuple:
        return (self.name, self.stat_key, *self.inner.key())
