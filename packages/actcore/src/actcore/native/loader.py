"""Load actcore's native kernels (CUDA, and CPU) on first use on a tensor of their device.

The ops' pure-PyTorch bodies (:mod:`actcore.ops.library`) call :func:`ready` when they
get a CUDA tensor. The first call builds the extension (cached, see :mod:`.build`), loads
it and registers its kernels as the ``CUDA`` implementation of the ``actcore::*`` ops;
from then on the dispatcher sends CUDA tensors straight to them. Any failure (no
toolkit, compile error, stale library) gives one :class:`NativeUnavailableWarning` and the
reference path stays, for the rest of the process; importing actcore never fails.
``ACTCORE_NATIVE=0`` turns the kernels off.

The CPU kernels (``csrc/cpu_kernels.cpp``, a separate library that needs no CUDA) work the
same way from the first op on a CPU tensor: built with the host compiler, cached, registered
as the ``CPU`` implementation, one warning and the reference path on any failure. They are
on by default (``CPU_DEFAULT_ON``); ``ACTCORE_NATIVE_CPU=0`` turns them off (``=1`` on),
and :func:`cpu_kernels` switches them in-process (tests run the reference both ways).
A forked process (DataLoader workers) inherits the loaded kernels and never rebuilds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CPU_DEFAULT_ON",
    "CPU_ISAS",
    "CPU_ONLY_OPS",
    "OPS",
    "NativeUnavailableWarning",
    "call",
    "cpu_active",
    "cpu_disabled",
    "cpu_isa",
    "cpu_kernels",
    "cpu_ready",
    "cpu_status",
    "disabled",
    "load",
    "load_cpu",
    "loaded",
    "ready",
    "register",
    "set_cpu_kernels",
    "status",
]

OPS = (
    "quantize",
    "dequantize",
    "pack_bits",
    "unpack_bits",
    "hash_uniform",
    "masked_quantize",
    "masked_dequantize",
    "apply_mask",
    "masked_quantize_padded",
)
CPU_ONLY_OPS = (
    "relu_mask",
    "quantize_scaled",
    "dequantize_scaled",
)  # CPU kernels only: on CUDA their references run
_OFF = {"0", "off", "false", "no"}
_ON = {"1", "on", "true", "yes"}
CPU_DEFAULT_ON = True  # the CPU kernels load on the first op on a CPU tensor


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


@dataclass
class _CpuState:
    attempted: bool = False
    active: bool = False  # registered as the ops' CPU kernels right now
    library: Path | None = None
    handle: ctypes.CDLL | None = None
    error: str | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)


_STATE = _State()
_CPU_STATE = _CpuState()
_LOCAL = threading.local()


def _after_fork_in_child() -> None:
    # A lock held by another thread of the parent (a build in progress) would never be
    # released in the child: give it fresh ones. The loaded kernels stay registered.
    _STATE.lock = threading.RLock()
    _CPU_STATE.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def disabled() -> bool:
    """Whether ``ACTCORE_NATIVE`` turns the native kernels off (0, off, false, no)."""
    return os.environ.get("ACTCORE_NATIVE", "").strip().lower() in _OFF


def cpu_disabled() -> bool:
    """Whether the CPU kernels are off: ``ACTCORE_NATIVE`` or ``ACTCORE_NATIVE_CPU`` off."""
    if disabled():
        return True
    value = os.environ.get("ACTCORE_NATIVE_CPU", "").strip().lower()
    if value in _OFF:
        return True
    return False if value in _ON else not CPU_DEFAULT_ON


def _open(library: str | os.PathLike, prefix: str, abi_version: int) -> ctypes.CDLL:
    """``library`` loaded, its ``<prefix>_abi_version()`` checked, its register entry typed."""
    from .build import NativeBuildError

    # the schemas come from actcore.ops.library, which the actcore package imports first
    undefined = [op for op in OPS + CPU_ONLY_OPS if not hasattr(torch.ops.actcore, op)]
    if undefined:
        raise NativeBuildError(f"the actcore::* ops {undefined} are not defined (import actcore)")
    lib = ctypes.CDLL(str(library))
    abi = getattr(lib, f"{prefix}_abi_version")()
    if abi != abi_version:
        raise NativeBuildError(f"{library} has interface version {abi}, expected {abi_version}")
    entry = getattr(lib, f"{prefix}_register")
    entry.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    entry.restype = ctypes.c_int
    return lib


def _register_kernels(
    entry: Any,
    what: str,
    key: str,
    undo: Callable[[], None] | None = None,
    ops: tuple[str, ...] = OPS,
) -> None:
    """Call a library's register ``entry``; check every op of ``ops`` now has a ``key``
    kernel."""
    from .build import NativeBuildError

    message = ctypes.create_string_buffer(8192)
    if entry(message, len(message)) != 0:
        raise NativeBuildError(
            f"registering the {what} failed: {message.value.decode(errors='replace')}"
        )
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is not None:
        missing = [op for op in ops if not has_kernel(f"actcore::{op}", key)]
        if missing:
            if undo is not None:
                undo()
            raise NativeBuildError(f"the {what} registered no {key} kernel for {missing}")


def _failed(
    state: _State | _CpuState, what: str, exc: Exception, hint: str, warn: bool, stacklevel: int
) -> bool:
    """Remember why loading ``what`` failed in ``state``; warn when ``warn`` (``stacklevel``
    counts from the caller, as for :func:`warnings.warn`). Returns False."""
    state.error = f"{type(exc).__name__}: {exc}"
    if warn:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(
            f"actcore: {what} unavailable ({type(exc).__name__}: {first_line}); using the "
            f"PyTorch reference implementation. {hint}",
            NativeUnavailableWarning,
            stacklevel=stacklevel + 1,
        )
    return False


def _load_once(
    state: _State | _CpuState,
    on: str,
    off: Callable[[], bool],
    why_off: str,
    load: Callable[[bool], bool],
    warn: bool,
) -> bool:
    """Run ``load(warn)`` on the first call, unless ``off()`` (``why_off`` is then the error);
    return whether the kernels are on (``state.<on>``) on every later call."""
    with state.lock:
        if state.attempted:
            return getattr(state, on)
        state.attempted = True
        if off():
            state.error = why_off
            return False
        return load(warn)


def register(library: str | os.PathLike) -> None:
    """Register the kernels of a built library as the ops' CUDA implementation.

    The ops must be defined first (importing :mod:`actcore.ops` does it). Runs no kernel.
    """
    from .build import ABI_VERSION

    lib = _open(library, "actcore_native", ABI_VERSION)
    _register_kernels(lib.actcore_native_register, f"CUDA kernels of {library}", "CUDA")


def load(*, warn: bool = True) -> bool:
    """Build (when not cached), load and register the CUDA kernels, once per process.

    True when the kernels are registered. Never raises: a failure is remembered (see
    :func:`status`), warned about once when ``warn``, and the reference path stays.
    """
    return _load_once(_STATE, "loaded", disabled, "turned off by ACTCORE_NATIVE", _load, warn)


def _load(warn: bool) -> bool:
    """Build (when not cached), load and register the CUDA kernels; False on any failure."""
    state = _STATE
    try:
        from . import build

        plan = build.plan_build()
        state.arches = plan.arches
        path = build.build(plan)
        register(path)
    except Exception as exc:  # any failure: stay on the reference path
        hint = "`actcore native status` and `actcore native build --check` say more."
        return _failed(state, "CUDA kernels", exc, hint, warn, stacklevel=5)
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
    """Run ``torch.ops.actcore.<op>`` again, now that its native kernel is registered."""
    _LOCAL.calling = True
    try:
        return getattr(torch.ops.actcore, op).default(*args)
    finally:
        _LOCAL.calling = False


# ------------------------------------------------------------------------------ CPU kernels
def _cpu_library(library: str | os.PathLike) -> ctypes.CDLL:
    from .build import CPU_ABI_VERSION

    lib = _open(library, "actcore_cpu", CPU_ABI_VERSION)
    lib.actcore_cpu_unregister.restype = None
    lib.actcore_cpu_limit_isa.restype = ctypes.c_int
    lib.actcore_cpu_limit_isa.argtypes = (ctypes.c_int,)
    lib.actcore_cpu_parallel_threads.restype = ctypes.c_int
    return lib


def _register_cpu(lib: ctypes.CDLL) -> None:
    _register_kernels(
        lib.actcore_cpu_register,
        "CPU kernels",
        "CPU",
        lib.actcore_cpu_unregister,
        OPS + CPU_ONLY_OPS,
    )


def _load_cpu(warn: bool, stacklevel: int = 5) -> bool:
    """Build (when not cached), load and register the CPU kernels; False on any failure."""
    state = _CPU_STATE
    try:
        if state.handle is None:
            from . import build

            path = build.build_cpu(build.plan_cpu_build())
            state.handle = _cpu_library(path)
            state.library = Path(path)
        _register_cpu(state.handle)
    except Exception as exc:  # any failure: stay on the reference path
        hint = "`actcore native status` says more; ACTCORE_NATIVE_CPU=0 turns them off."
        return _failed(state, "CPU kernels", exc, hint, warn, stacklevel)
    state.active = True
    state.error = None
    return True


def load_cpu(*, warn: bool = True) -> bool:
    """Build, load and register the CPU kernels, once per process (unless turned off).

    True when they are registered. Never raises; a failure is warned about once.
    """
    why_off = "turned off by ACTCORE_NATIVE or ACTCORE_NATIVE_CPU"
    return _load_once(_CPU_STATE, "active", cpu_disabled, why_off, _load_cpu, warn)


def cpu_ready(op: str) -> bool:
    """Hook of the ops' reference bodies on a CPU tensor: load the CPU kernels on first use.

    True when ``op`` now has a CPU kernel (hand over with :func:`call`); False inside such a
    hand-over, when turned off, and when the kernels are unavailable.
    """
    if getattr(_LOCAL, "calling", False) or (op not in OPS and op not in CPU_ONLY_OPS):
        return False
    state = _CPU_STATE
    if not state.attempted:
        load_cpu()
    return state.active


CPU_ISAS = ("baseline", "avx2", "avx512")


def cpu_isa(limit: str | None = None) -> str | None:
    """The instruction set the CPU kernels' hot loops run: the best of :data:`CPU_ISAS` this
    CPU has (on x86-64; "baseline" elsewhere), or None when the kernels are not loaded.

    ``limit`` first caps it for this process (``"avx512"`` lifts the cap), so each variant
    the CPU has can be run and compared; every variant gives bit for bit the same results.
    """
    if limit is not None and limit not in CPU_ISAS:
        raise ValueError(f"cpu_isa: limit must be one of {', '.join(CPU_ISAS)}; got {limit!r}")
    handle = _CPU_STATE.handle
    if handle is None:
        return None
    level = -1 if limit is None else CPU_ISAS.index(limit)
    return CPU_ISAS[handle.actcore_cpu_limit_isa(level)]


def cpu_active() -> bool:
    """Whether the CPU kernels are registered (CPU tensors run them) right now."""
    return _CPU_STATE.active


def set_cpu_kernels(enabled: bool, *, warn: bool = True) -> bool:
    """Register (building if needed) or unregister the CPU kernels for this process.

    An explicit switch: it overrides ``ACTCORE_NATIVE_CPU``. Returns whether they were
    active before. Turning them on can fail (a warning; they stay off).
    """
    state = _CPU_STATE
    with state.lock:
        before = state.active
        state.attempted = True  # no automatic load after an explicit choice
        if enabled and not state.active:
            _load_cpu(warn, stacklevel=4)
        elif not enabled and state.active:
            assert state.handle is not None
            state.handle.actcore_cpu_unregister()
            state.active = False
        return before


@contextlib.contextmanager
def cpu_kernels(enabled: bool) -> Iterator[bool]:
    """Run a block with the CPU kernels on or off; yields whether they are on."""
    before = set_cpu_kernels(enabled)
    try:
        yield _CPU_STATE.active
    finally:
        set_cpu_kernels(before, warn=False)


def _state_status(state: _State | _CpuState, on: str, off: bool) -> dict[str, Any]:
    """What ``state`` records: whether the kernels are on (under the key ``on``, the name of
    its flag), tried, from which library, the last error; ``off``: turned off by the
    environment."""
    return {
        on: getattr(state, on),
        "attempted": state.attempted,
        "library": str(state.library) if state.library else None,
        "error": state.error,
        "disabled": off,
    }


def _plan_status(plan: Callable[[], Any], *, arches: bool = False) -> dict[str, Any]:
    """What ``plan()`` says of a build (its architectures when ``arches``, its directory,
    whether it is built), or why it cannot plan one (never raises)."""
    from .build import NativeBuildError

    try:
        found = plan()
    except NativeBuildError as exc:
        return {"build_dir": None, "built": False, "plan_error": str(exc)}
    head = {"arches": list(found.arches)} if arches else {}
    return {**head, "build_dir": str(found.build_dir), "built": found.library.is_file()}


def cpu_status() -> dict[str, Any]:
    """What this process knows about the CPU kernels (never raises)."""
    state = _CPU_STATE
    info = _state_status(state, "active", cpu_disabled())
    info["isa"] = cpu_isa()
    info["threads"] = int(state.handle.actcore_cpu_parallel_threads()) if state.handle else None
    from . import build

    info.update(_plan_status(build.plan_cpu_build))
    return info


def status() -> dict[str, Any]:
    """What is loaded in this process, and what a build here would use (never raises)."""
    info = _state_status(_STATE, "loaded", disabled())
    info.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        devices=[],
    )
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
    info.update(_plan_status(build.plan_build, arches=True))
    info["cpu"] = cpu_status()
    return info
