"""Load actcore's CUDA kernels on first use on a CUDA tensor.

The ops' pure-PyTorch bodies (:mod:`actcore.ops.library`) call :func:`ready` when they
get a CUDA tensor. The first call builds the extension (cached, see :mod:`.build`), loads
it and registers its kernels as the ``CUDA`` implementation of the ``actcore::*`` ops;
from then on the dispatcher sends CUDA tensors straight to them. Any failure (no
toolkit, compile error, stale library) gives one :class:`NativeUnavailableWarning` and the
reference path stays, for the rest of the process; importing actcore never fails.
``ACTCORE_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

OPS = ("quantize", "dequantize", "pack_bits", "unpack_bits", "hash_uniform")
_OFF = {"0", "off", "false", "no"}


class NativeUnavailableWarning(RuntimeWarning):
    """actcore's CUDA kernels could not be built or loaded; the reference path runs."""


@dataclass
class _State:
    attempted: bool = False
    loaded: bool = False
    library: Path | None = None
    arches: tuple[str, ...] = ()
    error: str | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)


_STATE = _State()
_LOCAL = threading.local()


def disabled() -> bool:
    """Whether ``ACTCORE_NATIVE`` turns the native kernels off (0, off, false, no)."""
    return os.environ.get("ACTCORE_NATIVE", "").strip().lower() in _OFF


def register(library: str | os.PathLike) -> None:
    """Register the kernels of a built library as the ops' CUDA implementation.

    The ops must be defined first (importing :mod:`actcore.ops` does it). Runs no kernel.
    """
    from ..ops import library as _ops  # noqa: F401 - defines the actcore::* schemas
    from .build import ABI_VERSION, NativeBuildError

    lib = ctypes.CDLL(str(library))
    abi = lib.actcore_native_abi_version()
    if abi != ABI_VERSION:
        raise NativeBuildError(f"{library} has interface version {abi}, expected {ABI_VERSION}")
    lib.actcore_native_register.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.actcore_native_register.restype = ctypes.c_int
    message = ctypes.create_string_buffer(8192)
    if lib.actcore_native_register(message, len(message)) != 0:
        raise NativeBuildError(
            f"registering the CUDA kernels of {library} failed: "
            f"{message.value.decode(errors='replace')}"
        )
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is not None:
        missing = [op for op in OPS if not has_kernel(f"actcore::{op}", "CUDA")]
        if missing:
            raise NativeBuildError(f"{library} registered no CUDA kernel for {missing}")


def load(*, warn: bool = True) -> bool:
    """Build (when not cached), load and register the CUDA kernels, once per process.

    True when the kernels are registered. Never raises: a failure is remembered (see
    :func:`status`), warned about once when ``warn``, and the reference path stays.
    """
    state = _STATE
    with state.lock:
        if state.attempted:
            return state.loaded
        state.attempted = True
        if disabled():
            state.error = "turned off by ACTCORE_NATIVE"
            return False
        try:
            from . import build

            plan = build.plan_build()
            state.arches = plan.arches
            path = build.build(plan)
            register(path)
        except Exception as exc:  # any failure: stay on the reference path
            state.error = f"{type(exc).__name__}: {exc}"
            if warn:
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                warnings.warn(
                    f"actcore: CUDA kernels unavailable ({type(exc).__name__}: {first_line}); "
                    "using the PyTorch reference implementation. `actcore native status` and "
                    "`actcore native build --check` say more.",
                    NativeUnavailableWarning,
                    stacklevel=3,
                )
            return False
        state.loaded = True
        state.library = Path(path)
        return True


def loaded() -> bool:
    """Whether the CUDA kernels are registered in this process."""
    return _STATE.loaded


def ready(op: str) -> bool:
    """Hook of the ops' reference bodies on a CUDA tensor: load on first use.

    True when ``op`` now has a CUDA kernel, so the body should hand over with :func:`call`.
    False inside such a hand-over (never recurse) and when the kernels are unavailable.
    """
    if getattr(_LOCAL, "calling", False) or op not in OPS:
        return False
    if not _STATE.attempted:
        load()
    return _STATE.loaded


def call(op: str, *args: Any) -> Any:
    """Run ``torch.ops.actcore.<op>`` again, now that its CUDA kernel is registered."""
    _LOCAL.calling = True
    try:
        return getattr(torch.ops.actcore, op).default(*args)
    finally:
        _LOCAL.calling = False


def status() -> dict[str, Any]:
    """What is loaded in this process, and what a build here would use (never raises)."""
    state = _STATE
    info: dict[str, Any] = {
        "loaded": state.loaded,
        "attempted": state.attempted,
        "library": str(state.library) if state.library else None,
        "error": state.error,
        "disabled": disabled(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
    }
    if torch.cuda.is_available():
        info["devices"] = [
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        ]
    from . import build

    try:
        info["sources"] = str(build.source_dir())
    except build.NativeBuildError as exc:
        info["sources"] = None
        info["sources_error"] = str(exc)
    try:
        toolkit = build.find_cuda_toolkit()
        info["toolkit"] = {
            "root": str(toolkit.root),
            "nvcc": toolkit.version,
            "found_by": toolkit.found_by,
        }
    except build.NativeBuildError as exc:
        info["toolkit"] = None
        info["toolkit_error"] = str(exc)
    try:
        plan = build.plan_build()
        info["arches"] = list(plan.arches)
        info["build_dir"] = str(plan.build_dir)
        info["built"] = plan.library.is_file()
    except build.NativeBuildError as exc:
        info["build_dir"] = None
        info["built"] = False
        info["plan_error"] = str(exc)
    return info
