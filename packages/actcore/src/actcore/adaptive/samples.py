"""Per-dataset-sample gradient tables of adaptive bits (opt-in, ActNN's ``use_gradient``).

A batch's dataset indices (:meth:`~actcore.adaptive.AdaptiveBits.set_sample_index`) select
entries of a table per layer holding each dataset sample's squared output-gradient norm
``g`` (NaN: never seen). :func:`checked_index` checks a batch's indices,
:func:`batch_sample_scale` reads the batch's weights ``r_i = g_i / mean_batch(g)`` off a layer's
table (growing it), :func:`write_norms` writes a backward's norms into it; all on the
device, with no host reads. The model is in :mod:`actcore.adaptive`.
"""

from __future__ import annotations

import math

import torch

__all__: list[str] = []


def checked_index(index: object, num_samples: int | None) -> tuple[torch.Tensor, int]:
    """A batch's indices as int64 and 1 + the largest (0 if none); TypeError/ValueError if bad.

    Reads the values: free for a host tensor (as a DataLoader yields), one synchronisation
    for a device tensor.
    """
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"sample index must be a torch.Tensor, got {type(index).__name__}")
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(f"sample index must have an integer dtype, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"sample index must be 1-D, got shape {tuple(index.shape)}")
    end = 0
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0:
            raise ValueError(f"sample index has a negative entry {low}")
        if num_samples is not None and high >= num_samples:
            raise ValueError(f"sample index {high} out of range for num_samples={num_samples}")
        end = high + 1
    return index.detach().long(), end


def batch_sample_scale(
    table: torch.Tensor | None,
    index: torch.Tensor,
    layer: str,
    n: int,
    num_samples: int | None,
    index_end: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, r)``: a layer's table on ``device``, grown to cover the indices (to
    ``num_samples``, else geometrically), and ``r`` of the batch's samples (unseen ones
    count as the batch mean; all 1 before any is seen)."""
    if index.shape[0] != n:
        raise ValueError(
            f"sample index has {index.shape[0]} entries but layer {layer!r} got a batch of {n}"
        )
    size = num_samples or index_end
    if table is None or table.shape[0] < size:
        old = 0 if table is None else table.shape[0]
        length = size if num_samples else max(size, 2 * old)  # grow geometrically
        grown = torch.full((length,), math.nan, device=device)
        if table is not None:
            grown[:old] = table.to(device)
        table = grown
    table = table.to(device)
    seen = table.index_select(0, index)
    filled = torch.where(seen.isnan(), seen.nanmean(), seen)  # all NaN when none seen
    mean = filled.mean()
    return table, torch.where(mean > 0, filled / mean, torch.ones_like(filled))


def write_norms(
    table: torch.Tensor, index: torch.Tensor, norms: torch.Tensor, momentum: float
) -> None:
    """The batch's samples' squared gradient norms into ``table``, averaged with ``momentum``
    over visits (a sample's first norm taken as it is)."""
    old = table.index_select(0, index)
    mixed = torch.where(old.isnan(), norms, old * momentum + norms * (1 - momentum))
    # a non-finite norm leaves the sample's entry as it was
    table.index_copy_(0, index, torch.where(norms.isfinite(), mixed, old))
