"""Build actcore's CUDA kernels (``csrc/``) with ``torch.utils.cpp_extension`` and ninja.

Everything the build needs is found here, so a user sets no environment variable:

* the sources: ``actcore/native/csrc`` (package data in a wheel; in a source checkout a
  link to the repository's ``csrc/``), else a ``csrc/`` directory above this package;
* the CUDA toolkit root: ``$CUDA_HOME``/``$CUDA_PATH`` when set (and then it must be
  valid), else the root that the ``nvcc`` on ``PATH`` reports (``nvcc --dryrun`` prints
  it, so wrapper scripts and links work; torch's own guess, the parent of nvcc's folder,
  is wrong for those), else ``/usr/local/cuda``, ``/usr/local/cuda-*``, ``/opt/cuda``;
* the architectures: ``arch`` when given, else ``$TORCH_CUDA_ARCH_LIST``, else the
  visible GPUs', else ``DEFAULT_ARCH`` (9.0). They are passed as ``-gencode`` flags, so
  torch never probes for a GPU (it fails without one when no list is set);
* the CUDA library headers of torch's pip wheels (``nvidia/cu13/include``), searched
  after the toolkit's own (``-idirafter``), for sources that include them.

Builds are cached under ``~/.cache/actcore/native`` (``$XDG_CACHE_HOME`` respected) in a
directory named after a digest of the sources, flags, toolkit, torch and Python: a change
to any of them builds afresh, an unchanged setup reuses the library.

The CPU kernels (``cpu_kernels.cpp``) are a separate, CUDA-free library built the same way
with the host C++ compiler (:func:`plan_cpu_build`, :func:`build_cpu`), so CPU users need
no CUDA toolkit. Concurrent first uses (pytest workers, DDP processes, tox envs) are
serialised by the OS-level file lock that ``torch.utils.cpp_extension`` holds in the build
directory, which the kernel releases if its holder dies.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cpu_build
from .arches import DEFAULT_ARCH, arch_label, default_arches, gencode_flags, parse_arches
from .compiler import cache_root, compile_library, find_sources, safe_name
from .cpu_build import *  # noqa: F403 - the CPU build's names stay importable from here
from .errors import NativeBuildError
from .toolkit import CudaToolkit, check_torch_cuda, find_cuda_toolkit, wheel_include_dirs

__all__ = [
    "ABI_VERSION",
    "CUDA_FLAGS",
    "CXX_FLAGS",
    "DEFAULT_ARCH",
    "EXTENSION_NAME",
    "HEADERS",
    "SOURCES",
    "BuildPlan",
    "CudaToolkit",
    "NativeBuildError",
    "arch_label",
    "build",
    "cache_root",
    "check_torch_cuda",
    "default_arches",
    "find_cuda_toolkit",
    "gencode_flags",
    "parse_arches",
    "plan_build",
    "source_dir",
    "timed_build",
    "wheel_include_dirs",
    *cpu_build.__all__,
]

EXTENSION_NAME = "actcore_native"
SOURCES = ("kernels.cu", "quantize_kernels.cu", "ops.cpp")
HEADERS = (
    "actcore_native.h",
    "kernel_common.cuh",
    "op_args.h",
    "op_checks.h",
    "op_registration.h",
)
ABI_VERSION = 3  # csrc/actcore_native.h: kAbiVersion
# IEEE behaviour the bit-exactness relies on (see csrc/kernel_common.cuh): no fused multiply-add,
# denormals kept, correctly rounded division and square root.
CUDA_FLAGS = ("-O3", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
CXX_FLAGS = ("-O2",)


@dataclass(frozen=True)
class BuildPlan:
    """What :func:`build` compiles, with which flags, into which directory."""

    sources: tuple[Path, ...]
    toolkit: CudaToolkit
    arches: tuple[str, ...]
    build_dir: Path
    cuda_flags: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    include_dirs: tuple[Path, ...] = field(default=())

    @property
    def library(self) -> Path:
        return self.build_dir / f"{EXTENSION_NAME}.so"


def source_dir() -> Path:
    """The directory holding the C++/CUDA sources (package data, or the checkout's csrc/)."""
    return find_sources(SOURCES + HEADERS)


def plan_build(
    arch: str | Sequence[str] | None = None, build_dir: str | os.PathLike | None = None
) -> BuildPlan:
    """Resolve sources, toolkit, architectures, flags and the cached build directory."""
    src = source_dir()
    toolkit = find_cuda_toolkit()
    check_torch_cuda(toolkit)
    try:
        if arch is None:
            arches = default_arches()
        elif isinstance(arch, str):
            arches = parse_arches(arch)
        else:
            arches = [a for item in arch for a in parse_arches(item)]
    except ValueError as exc:
        raise NativeBuildError(str(exc)) from exc
    includes = wheel_include_dirs()
    cuda_flags = (*CUDA_FLAGS, *gencode_flags(arches))
    cxx_flags = (*CXX_FLAGS, *(f for d in includes for f in ("-idirafter", str(d))))
    sources = tuple(src / name for name in SOURCES)
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    for part in (
        *cuda_flags,
        *cxx_flags,
        str(toolkit.root),
        toolkit.version,
        torch.__version__,
        sys.version,
        str(ABI_VERSION),
    ):
        digest.update(part.encode() + b"\0")
    if build_dir is None:
        tag = "-".join(
            [
                f"py{sys.version_info.major}{sys.version_info.minor}",
                f"torch{torch.__version__}",
                f"cuda{toolkit.version}",
                "sm" + "_".join(arches),
                digest.hexdigest()[:16],
            ]
        )
        build_dir = cache_root() / safe_name(tag)
    return BuildPlan(
        sources=sources,
        toolkit=toolkit,
        arches=tuple(arches),
        build_dir=Path(build_dir),
        cuda_flags=cuda_flags,
        cxx_flags=cxx_flags,
        include_dirs=tuple(includes),
    )


@contextlib.contextmanager
def _cuda_home(root: Path) -> Iterator[None]:
    """Point torch's extension builder at ``root`` (it reads CUDA_HOME once, at import)."""
    from torch.utils import cpp_extension  # already imported by build()

    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = str(root)
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def build(plan: BuildPlan, verbose: bool = False) -> Path:
    """Compile and link ``plan`` with ninja (a no-op when cached) and load the library.

    Loading runs no kernel and needs no GPU: the kernels register only when
    :func:`actcore.native.loader.register` is called. NativeBuildError on any failure,
    with the compiler's output.
    """
    with _cuda_home(plan.toolkit.root):
        return compile_library(
            EXTENSION_NAME,
            plan.sources,
            plan.build_dir,
            plan.cxx_flags,
            plan.cuda_flags,
            with_cuda=True,
            verbose=verbose,
        )


def timed_build(plan: BuildPlan, verbose: bool = False) -> tuple[Path, float]:
    """:func:`build`, and the seconds it took."""
    start = time.perf_counter()
    path = build(plan, verbose=verbose)
    return path, time.perf_counter() - start
