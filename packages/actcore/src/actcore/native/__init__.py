"""actcore's native (CUDA) kernels: built from ``csrc/`` on first use, cached, optional.

The ops in :mod:`actcore.ops` always work through their pure-PyTorch reference; on a CUDA
tensor the first call builds and registers these kernels (see :mod:`.loader`), which
give bit-identical results. ``actcore native build --check`` compiles them without a GPU,
``actcore native status`` says what is loaded. ``ACTCORE_NATIVE=0`` turns them off.
"""

from __future__ import annotations

from .loader import NativeUnavailableWarning, load, loaded, status

__all__ = ["NativeUnavailableWarning", "load", "loaded", "status"]
