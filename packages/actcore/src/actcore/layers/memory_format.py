"""The memory format (contiguous or channels-last) a tensor's strides are laid out in."""

from __future__ import annotations

import torch

__all__ = ["suggest_memory_format"]


def suggest_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout ATen's ``suggest_memory_format`` picks (channels-last strides or not)."""
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}
    layout = layouts.get(x.dim())
    if layout is not None and not x.is_contiguous() and x.is_contiguous(memory_format=layout):
        return layout
    return torch.contiguous_format
