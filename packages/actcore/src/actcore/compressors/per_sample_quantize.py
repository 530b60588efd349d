"""``PerSampleQuantize``: quantization with bits chosen per sample (ActNN's adaptive bits).

:func:`sample_range_weights` ranks the samples of a batch by how much bits help them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ops
from .base import Compressor, Tensors

__all__ = ["PerSampleQuantize", "sample_range_weights"]


def sample_range_weights(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per sample, ``sum over its groups of size * range^2`` (float32, shape ``[N]``).

    Stochastic rounding of a group at ``b`` bits adds variance at most
    ``range^2 / (4 (2^b - 1)^2)`` per element, so this is (4 times) the sample's rounding
    variance at one step per range; it ranks samples by how much bits help them.
    """
    flat = x.detach().reshape(x.shape[0], -1)
    n, m = flat.shape
    if m == 0:
        return flat.new_zeros(n, dtype=torch.float32)
    full = m - m % group_size
    spans = []
    if full:  # the whole groups, as a view (no copy, whatever the row's length)
        groups = flat.unfold(1, group_size, group_size)
        spans.append(groups.amax(-1) - groups.amin(-1))
    if full < m:  # the last group, shorter (a graph's node: one group of its features)
        tail = flat[:, full:]
        spans.append((tail.amax(-1) - tail.amin(-1)).unsqueeze(1))
    span = (spans[0] if len(spans) == 1 else torch.cat(spans, 1)).float()
    return (span.square() * group_size).sum(-1)


@dataclass(frozen=True)
class PerSampleQuantize(Compressor):
    """Per-group quantization with bits chosen per sample (ActNN-style adaptive bits).

    ``counts`` lists ``(bits, number of samples)``, most bits first, summing to the batch
    size. ``pack`` ranks the samples by :func:`sample_range_weights` (largest first) and
    gives the first ``counts[0][1]`` samples ``counts[0][0]`` bits, and so on; each bits
    class is quantized as one contiguous block. Counts are host data and the ranking stays
    on the device, so no host synchronisation is needed. Unbiased, as :class:`Quantize`.
    """

    counts: tuple[tuple[int, int], ...]
    group_size: int = 256
    stochastic: bool = True
    # sample_range_weights of the tensor to pack, when the caller has it already (the same
    # result, one pass less); not part of the compressor's identity
    weights: torch.Tensor | None = field(default=None, compare=False, repr=False)
    name = "per_sample_quantize"
    lossy = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.stochastic

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        if sum(c for _, c in self.counts) != x.shape[0]:
            raise ValueError(f"counts {self.counts} do not cover a batch of {x.shape[0]}")
        weights = self.weights
        if weights is None:
            weights = sample_range_weights(x, self.group_size)
        order = torch.argsort(weights, descending=True)
        ranked = x.detach().index_select(0, order)
        tensors: list[torch.Tensor] = [order.to(torch.int32)]
        metas = []
        start = 0
        for bits, count in self.counts:
            if count == 0:
                continue
            p = ops.quantize(
                ranked[start : start + count],
                bits,
                group_size=self.group_size,
                stochastic=self.stochastic,
            )
            tensors.extend(p.tensors())
            metas.append((p.shape, p.dtype, p.bits, p.group_size, p.per_sample))
            start += count
        return tuple(tensors), tuple(metas)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        order = tensors[0].long()
        parts = [
            ops.dequantize(ops.Packed(*tensors[1 + 3 * i : 4 + 3 * i], *m))
            for i, m in enumerate(meta)
        ]
        ranked = torch.cat(parts)
        return torch.empty_like(ranked).index_copy_(0, order, ranked)

    def key(self) -> tuple:
        return (self.name, self.counts, self.group_size, self.stochastic)
