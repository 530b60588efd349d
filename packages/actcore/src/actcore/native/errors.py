"""The one error of the native build: the kernels cannot be built or loaded here."""

from __future__ import annotations

__all__ = ["NativeBuildError"]


class NativeBuildError(RuntimeError):
    """The CUDA kernels cannot be built or loaded here; the message says why."""
