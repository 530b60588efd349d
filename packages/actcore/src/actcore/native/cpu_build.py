"""The CPU kernels (``cpu_kernels.cpp``): a CUDA-free library built with the host C++
compiler, with flags that keep them bit-exact with the reference, cached like the CUDA one."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .compiler import cache_root, compile_library, find_sources, safe_name

__all__ = [
    "CPU_ABI_VERSION",
    "CPU_CXX_FLAGS",
    "CPU_EXTENSION_NAME",
    "CPU_HEADERS",
    "CPU_MSVC_FLAGS",
    "CPU_OPENMP_FLAGS",
    "CPU_SOURCES",
    "CpuBuildPlan",
    "build_cpu",
    "cpu_cxx_flags",
    "cpu_openmp_flags",
    "cpu_source_dir",
    "plan_cpu_build",
]

CPU_EXTENSION_NAME = "actcore_native_cpu"
CPU_SOURCES = ("cpu_kernels.cpp",)
CPU_HEADERS = ("op_args.h", "op_checks.h", "op_registration.h")
CPU_ABI_VERSION = 7  # csrc/cpu_kernels.cpp: kAbiVersion
# Bit-exactness with the reference: no fused multiply-add (GCC contracts by default), no
# fast-math. The hot loops pick their ISA (baseline, AVX2, AVX-512) at run time: no -march flag,
# so a cached library runs on any CPU of the architecture.
CPU_CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi")
CPU_MSVC_FLAGS = ("/O2", "/fp:precise")
# at::parallel_for is a header template: where ATen's backend is OpenMP, its ``#pragma omp
# parallel`` only splits the work when the extension itself is compiled with OpenMP (without
# it every kernel ran on one thread). Linked against the libgomp torch has already loaded.
CPU_OPENMP_FLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class CpuBuildPlan:
    """What :func:`build_cpu` compiles (one C++ file, no CUDA), with which flags, where."""

    sources: tuple[Path, ...]
    build_dir: Path
    cxx_flags: tuple[str, ...]

    @property
    def library(self) -> Path:
        return self.build_dir / f"{CPU_EXTENSION_NAME}.so"


def cpu_source_dir() -> Path:
    """The directory holding the CPU kernels' source (``cpu_kernels.cpp``)."""
    return find_sources(CPU_SOURCES + CPU_HEADERS)


def cpu_cxx_flags() -> tuple[str, ...]:
    """The compiler flags of the CPU kernels on this platform (with OpenMP on Linux where
    torch's own parallel backend is OpenMP, so the kernels use torch's threads)."""
    if sys.platform == "win32":
        return CPU_MSVC_FLAGS
    return CPU_CXX_FLAGS + cpu_openmp_flags()


def cpu_openmp_flags() -> tuple[str, ...]:
    """:data:`CPU_OPENMP_FLAGS` on Linux when torch runs its CPU ops on OpenMP, else none
    (macOS's clang has no ``-fopenmp``; the kernels then run on one thread)."""
    openmp = torch.backends.openmp.is_available() and "OpenMP" in torch.__config__.parallel_info()
    return CPU_OPENMP_FLAGS if sys.platform.startswith("linux") and openmp else ()


def plan_cpu_build(build_dir: str | os.PathLike | None = None) -> CpuBuildPlan:
    """Resolve the CPU kernels' source, flags and cached build directory (needs no CUDA)."""
    src = cpu_source_dir()
    flags = cpu_cxx_flags()
    digest = hashlib.sha256()
    for name in CPU_SOURCES + CPU_HEADERS:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    compiler = os.environ.get("CXX", "c++")
    for part in (*flags, compiler, platform.machine(), torch.__version__, sys.version):
        digest.update(part.encode() + b"\0")
    digest.update(str(CPU_ABI_VERSION).encode())
    if build_dir is None:
        tag = "-".join(
            [
                "cpu",
                f"py{sys.version_info.major}{sys.version_info.minor}",
                f"torch{torch.__version__}",
                platform.machine() or "unknown",
                digest.hexdigest()[:16],
            ]
        )
        build_dir = cache_root() / safe_name(tag)
    return CpuBuildPlan(
        sources=tuple(src / name for name in CPU_SOURCES),
        build_dir=Path(build_dir),
        cxx_flags=flags,
    )


def build_cpu(plan: CpuBuildPlan, verbose: bool = False) -> Path:
    """Compile and link the CPU kernels (a no-op when cached) and load the library."""
    return compile_library(
        CPU_EXTENSION_NAME,
        plan.sources,
        plan.build_dir,
        plan.cxx_flags,
        (),
        with_cuda=False,
        verbose=verbose,
        ld_flags=tuple(f for f in plan.cxx_flags if f in CPU_OPENMP_FLAGS),
    )
