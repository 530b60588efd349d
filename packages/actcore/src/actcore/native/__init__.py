"""actcore's native kernels (CUDA, and C++ for CPU): built from ``csrc/`` on first use, cached.

The ops in :mod:`actcore.ops` always work through their pure-PyTorch reference; on a CUDA
(or CPU) tensor the first call builds and registers the kernels of that device (see
:mod:`.loader`), which give bit-identical results. ``actcore native build --check``
compiles the CUDA kernels without a GPU, ``actcore native status`` says what is loaded.
``ACTCORE_NATIVE=0`` turns all of them off, ``ACTCORE_NATIVE_CPU=0`` the CPU kernels.
"""

from __future__ import annotations

from .loader import NativeUnavailableWarning, cpu_kernels, load, load_cpu, loaded, status

__all__ = ["NativeUnavailableWarning", "cpu_kernels", "load", "load_cpu", "loaded", "status"]
