"""L5's defragmentation: PyTorch's ``expandable_segments`` CUDA allocator setting."""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["enable_expandable_segments"]

_SETTING = "expandable_segments:True"


def enable_expandable_segments() -> bool:
    """Turn on expandable segments; True if it is (or will be) in effect.

    Before CUDA is initialised the environment variable is enough; afterwards the
    allocator is reconfigured through ``torch.cuda.memory._set_allocator_settings``
    where this PyTorch has it, else a warning says to set the variable before start-up.
    """
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in current:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{current},{_SETTING}" if current else _SETTING
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        warnings.warn(
            "CUDA is already initialised and this PyTorch cannot change allocator settings at "
            f"run time: set PYTORCH_CUDA_ALLOC_CONF={_SETTING} before starting Python",
            stacklevel=2,
        )
        return False
    setter(_SETTING)
    return True
