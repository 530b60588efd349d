"""DropIT's min-k compressor: the largest-magnitude elements of a tensor and where they were.

Also the settings it takes: the dropping rate ``gamma`` and the strategies (whole tensor or
per sample), validated here once for the layers and the conversion.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from actcore import ops
from actcore.layers.memory_format import suggest_memory_format

__all__ = [
    "STRATEGIES",
    "Kept",
    "check_gamma",
    "check_strategy",
    "drop_mink",
    "num_kept",
]

STRATEGIES: dict[str, str] = {
    "mink": "drop the gamma fraction of smallest-magnitude elements of the whole input",
    "mink_sample": "drop the gamma fraction of smallest-magnitude elements of each sample",
}

_INDEX_DTYPES = ((torch.int16, 2**15 - 1), (torch.int32, 2**31 - 1))


def check_gamma(gamma: object) -> float:
    if (
        isinstance(gamma, bool)
        or not isinstance(gamma, numbers.Real)
        or not math.isfinite(float(gamma))
        or not 0.0 <= float(gamma) < 1.0
    ):
        raise ValueError(
            f"gamma must be a number in [0, 1) (the fraction of input elements dropped), got "
            f"{gamma!r}; to train without a weight gradient freeze the layer instead"
        )
    return float(gamma)


def check_strategy(strategy: object) -> str:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(
            f"unknown DropIT strategy {strategy!r}; expected one of "
            f"{', '.join(repr(s) for s in STRATEGIES)}"
        )
    return strategy


def num_kept(numel: int, gamma: float) -> int:
    """Elements min-k keeps out of ``numel``: all but ``floor(gamma * numel)`` (at least 1)."""
    gamma = check_gamma(gamma)
    if numel <= 0:
        return 0
    dropped = gamma * numel
    dropped = math.floor(dropped + 1e-9 * max(1.0, dropped))  # 0.29 * 100 drops 29, not 28
    return numel - min(dropped, numel - 1)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a :class:`Kept` is laid out: what the tensors mean, without the tensors."""

    encoding: str  # "dense" (nothing dropped), "bitmap", "int16" or "int32"
    shape: torch.Size
    rows: int  # 1 for "mink", the batch size for "mink_sample"
    kept: int  # kept elements per row
    memory_format: torch.memory_format


@dataclasses.dataclass(frozen=True, eq=False)
class Kept:
    """What min-k keeps of a tensor: its kept values and where they were.

    ``values`` holds the kept elements (row-major order for a bitmap, offset order otherwise);
    ``index`` is a uint8 bitmap from :func:`actcore.ops.pack_mask`, int16/int32 offsets within
    each row, or ``None`` when nothing was dropped (then ``values`` is the tensor itself).
    """

    values: Tensor
    index: Tensor | None
    layout: _Layout

    @property
    def encoding(self) -> str:
        """``"dense"``, ``"bitmap"``, ``"int16"`` or ``"int32"``."""
        return self.layout.encoding

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        """The stored tensors (what :mod:`actcore.memory` counts)."""
        return (self.values,) if self.index is None else (self.values, self.index)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], layout: _Layout) -> Kept:
        """Rebuild from :meth:`tensors` and the layout (after ``save_for_backward``)."""
        index = tensors[1] if len(tensors) > 1 else None
        return cls(tensors[0], index, layout)

    def restore(self) -> Tensor:
        """The original tensor with the dropped elements set to zero."""
        lay = self.layout
        if self.index is None:
            return self.values
        numel = lay.shape.numel()
        if lay.encoding == "bitmap":
            mask = ops.unpack_mask(self.index, (numel,))
            dense = self.values.new_zeros(numel).masked_scatter_(mask, self.values)
        else:
            dense = self.values.new_zeros(lay.rows, numel // lay.rows)
            dense.scatter_(1, self.index.long(), self.values.view(lay.rows, lay.kept))
        dense = dense.view(lay.shape)
        if lay.memory_format != torch.contiguous_format:
            dense = dense.contiguous(memory_format=lay.memory_format)
        return dense


def _encoding(rows: int, row_len: int, kept: int) -> str:
    """The cheapest position encoding: a bitmap or narrow offsets (ties go to the bitmap)."""
    best, best_bytes = "bitmap", (rows * row_len + 7) // 8
    for dtype, limit in _INDEX_DTYPES:
        nbytes = rows * kept * (torch.iinfo(dtype).bits // 8)
        if row_len <= limit and nbytes < best_bytes:
            best, best_bytes = str(dtype).removeprefix("torch."), nbytes
    return best


def drop_mink(x: Tensor, gamma: float, *, rows: int = 1) -> Kept:
    """Keep the ``num_kept(numel / rows, gamma)`` largest-magnitude elements of each row.

    ``x`` is seen as ``rows`` rows in row-major order (``rows=1``: the whole tensor, DropIT's
    "mink"; ``rows=x.shape[0]``: each sample). NaNs count as largest and are kept.
    """
    gamma = check_gamma(gamma)
    numel = x.numel()
    if not isinstance(rows, int) or rows < 1 or numel % rows:
        raise ValueError(f"rows must be a positive divisor of x.numel()={numel}, got {rows!r}")
    row_len = numel // rows
    kept = num_kept(row_len, gamma)
    fmt = suggest_memory_format(x)
    if kept == row_len:
        return Kept(x, None, _Layout("dense", x.shape, rows, kept, fmt))
    flat = x.reshape(rows, row_len)
    top = flat.abs().topk(kept, dim=1, sorted=False).indices
    encoding = _encoding(rows, row_len, kept)
    layout = _Layout(encoding, x.shape, rows, kept, fmt)
    if encoding == "bitmap":
        mask = torch.zeros(rows, row_len, dtype=torch.bool, device=x.device)
        mask.scatter_(1, top, True)
        return Kept(flat[mask], ops.pack_mask(mask), layout)
    top = top.sort(dim=1).values
    index = top.to(torch.int16 if encoding == "int16" else torch.int32)
    return Kept(flat.gather(1, top).reshape(-1), index, layout)
