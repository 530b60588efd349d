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
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "ABI_VERSION",
    "CPU_ABI_VERSION",
    "CPU_CXX_FLAGS",
    "CPU_EXTENSION_NAME",
    "CPU_HEADERS",
    "CPU_MSVC_FLAGS",
    "CPU_SOURCES",
    "CUDA_FLAGS",
    "CXX_FLAGS",
    "DEFAULT_ARCH",
    "EXTENSION_NAME",
    "HEADERS",
    "SOURCES",
    "BuildPlan",
    "CpuBuildPlan",
    "CudaToolkit",
    "NativeBuildError",
    "arch_label",
    "build",
    "build_cpu",
    "cache_root",
    "check_torch_cuda",
    "cpu_cxx_flags",
    "cpu_source_dir",
    "default_arches",
    "find_cuda_toolkit",
    "gencode_flags",
    "parse_arches",
    "plan_build",
    "plan_cpu_build",
    "source_dir",
    "timed_build",
    "wheel_include_dirs",
]

EXTENSION_NAME = "actcore_native"
SOURCES = ("kernels.cu", "ops.cpp")
HEADERS = ("actcore_native.h", "op_args.h", "op_checks.h", "op_registration.h")
ABI_VERSION = 2  # csrc/actcore_native.h: kAbiVersion
DEFAULT_ARCH = "9.0"
# IEEE behaviour the bit-exactness relies on (see csrc/kernels.cu): no fused multiply-add,
# denormals kept, correctly rounded division and square root.
CUDA_FLAGS = ("-O3", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
CXX_FLAGS = ("-O2",)
CPU_EXTENSION_NAME = "actcore_native_cpu"
CPU_SOURCES = ("cpu_kernels.cpp",)
CPU_HEADERS = ("op_args.h", "op_checks.h", "op_registration.h")
CPU_ABI_VERSION = 2  # csrc/cpu_kernels.cpp: kAbiVersion
# Bit-exactness with the reference: no fused multiply-add (GCC contracts by default), no
# fast-math. The hot loops pick their ISA (baseline or AVX2) at run time: no -march flag,
# so a cached library runs on any CPU of the architecture.
CPU_CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi")
CPU_MSVC_FLAGS = ("/O2", "/fp:precise")
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


class NativeBuildError(RuntimeError):
    """The CUDA kernels cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit: its root (``bin/nvcc``, ``include/``), nvcc's version, how found."""

    root: Path
    version: str
    found_by: str

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"


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


# ------------------------------------------------------------------------------ sources
def _find_sources(names: Sequence[str]) -> Path:
    here = Path(__file__).resolve().parent
    candidates = [here / "csrc", *(parent / "csrc" for parent in here.parents)]
    for candidate in candidates:
        if all((candidate / name).is_file() for name in names):
            return candidate
    raise NativeBuildError(
        f"actcore's C++/CUDA sources ({', '.join(names)}) were not found in "
        f"{here / 'csrc'} nor in a csrc/ directory above it; reinstall actcore"
    )


def source_dir() -> Path:
    """The directory holding the C++/CUDA sources (package data, or the checkout's csrc/)."""
    return _find_sources(SOURCES + HEADERS)


def cpu_source_dir() -> Path:
    """The directory holding the CPU kernels' source (``cpu_kernels.cpp``)."""
    return _find_sources(CPU_SOURCES + CPU_HEADERS)


# ------------------------------------------------------------------------------ toolkit
def _is_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file()


def _nvcc_reported_root(nvcc: str) -> Path | None:
    """The toolkit root that ``nvcc`` itself uses (its ``TOP``), whatever wraps it."""
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return Path(match.group(1).strip()).resolve() if match else None


def _nvcc_version(root: Path) -> str:
    try:
        out = subprocess.run(
            [str(root / "bin" / "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"cannot run {root / 'bin' / 'nvcc'}: {exc}") from exc
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if not match:
        raise NativeBuildError(f"{root / 'bin' / 'nvcc'} --version printed no release number")
    return f"{match.group(1)}.{match.group(2)}"


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.name))


def find_cuda_toolkit() -> CudaToolkit:
    """Locate the CUDA toolkit that builds the kernels; NativeBuildError when there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            root = Path(value).expanduser()
            if not _is_toolkit(root):
                raise NativeBuildError(
                    f"{var}={value!r} is not a CUDA toolkit root (no bin/nvcc and "
                    f"include/cuda_runtime.h under it); correct it, or unset it to let "
                    f"actcore use the nvcc on PATH"
                )
            return CudaToolkit(root.resolve(), _nvcc_version(root), f"${var}")
    candidates: list[tuple[Path, str]] = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        reported = _nvcc_reported_root(nvcc)
        if reported is not None:
            candidates.append((reported, f"nvcc on PATH ({nvcc})"))
        candidates.append((Path(nvcc).resolve().parent.parent, f"nvcc on PATH ({nvcc})"))
    defaults = [Path("/usr/local/cuda")]
    defaults += sorted(Path("/usr/local").glob("cuda-*"), key=_version_key, reverse=True)
    defaults.append(Path("/opt/cuda"))
    candidates += [(path, "default location") for path in defaults]
    for root, found_by in candidates:
        if _is_toolkit(root):
            root = root.resolve()
            return CudaToolkit(root, _nvcc_version(root), found_by)
    raise NativeBuildError(
        "no CUDA toolkit found: no nvcc on PATH, and none of /usr/local/cuda, "
        f"/usr/local/cuda-*, /opt/cuda holds one; install the CUDA toolkit {torch.version.cuda} "
        "(nvcc), or set CUDA_HOME to its root"
    )


def check_torch_cuda(toolkit: CudaToolkit) -> None:
    """The toolkit must match the CUDA major version torch was built with."""
    if torch.version.cuda is None:
        raise NativeBuildError(f"this torch ({torch.__version__}) was built without CUDA")
    if toolkit.version.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise NativeBuildError(
            f"nvcc {toolkit.version} at {toolkit.root} does not match torch's CUDA "
            f"{torch.version.cuda}; install a CUDA {torch.version.cuda.split('.')[0]}.x "
            "toolkit, or point CUDA_HOME at one"
        )


def wheel_include_dirs() -> list[Path]:
    """``nvidia/cu<major>/include`` of the installed NVIDIA pip wheels (torch's CUDA libs)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations or torch.version.cuda is None:
        return []
    major = torch.version.cuda.split(".")[0]
    dirs = []
    for location in spec.submodule_search_locations:
        combined = Path(location) / f"cu{major}" / "include"  # CUDA 13 wheels: one tree
        if combined.is_dir():
            dirs.append(combined)
        else:  # older wheels: one directory per library
            dirs += sorted(p for p in Path(location).glob("*/include") if p.is_dir())
    return dirs


# ------------------------------------------------------------------------------ arches
def parse_arches(text: str) -> list[str]:
    """``"9.0"``, ``"8.0;9.0+PTX"`` or ``"8.6, 9.0"`` as a list; ValueError naming a bad one."""
    items = [item for item in re.split(r"[;,\s]+", text.strip()) if item]
    if not items:
        raise ValueError(f"no CUDA architecture in {text!r}")
    for item in items:
        if not _ARCH_RE.match(item):
            raise ValueError(
                f"invalid CUDA architecture {item!r}: expected a compute capability such as "
                "9.0, 8.6, 9.0a or 9.0+PTX"
            )
    return items


def default_arches() -> list[str]:
    """``$TORCH_CUDA_ARCH_LIST``, else the visible GPUs' compute capabilities, else 9.0."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return parse_arches(env)
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{major}.{minor}" for major, minor in sorted(caps)]
    return [DEFAULT_ARCH]


def arch_label(arch: str) -> str:
    """``"9.0"`` -> ``"sm_90"``, ``"9.0+PTX"`` -> ``"sm_90+PTX"``."""
    match = _ARCH_RE.match(arch)
    if match is None:
        return arch
    return f"sm_{match.group(1)}{match.group(2)}{match.group(3)}{match.group(4) or ''}"


def gencode_flags(arches: Sequence[str]) -> list[str]:
    flags = []
    for arch in arches:
        match = _ARCH_RE.match(arch)
        if match is None:
            raise ValueError(f"invalid CUDA architecture {arch!r}")
        num = f"{match.group(1)}{match.group(2)}{match.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if match.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


# ------------------------------------------------------------------------------ plan/build
def cache_root() -> Path:
    """``$XDG_CACHE_HOME/actcore/native``, by default ``~/.cache/actcore/native``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actcore" / "native"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


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
        build_dir = cache_root() / _safe(tag)
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
        return _compile(
            EXTENSION_NAME,
            plan.sources,
            plan.build_dir,
            plan.cxx_flags,
            plan.cuda_flags,
            with_cuda=True,
            verbose=verbose,
        )


def _compile(
    name: str,
    sources: Sequence[Path],
    build_dir: Path,
    cxx_flags: Sequence[str],
    cuda_flags: Sequence[str],
    *,
    with_cuda: bool,
    verbose: bool,
) -> Path:
    """``cpp_extension.load`` of a library (not a Python module); NativeBuildError on failure."""
    import logging

    if shutil.which("ninja") is None and not _ninja_from_pip():
        raise NativeBuildError("ninja is not installed (`pip install ninja`)")
    build_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    if not verbose:  # torch's notes ("No CUDA runtime is found, using CUDA_HOME=<its guess>")
        logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension

        path = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=list(cxx_flags),
            extra_cuda_cflags=list(cuda_flags) if with_cuda else None,
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=with_cuda,
            is_python_module=False,
        )
    except NativeBuildError:
        raise
    except Exception as exc:  # the compiler's output is in the message
        raise NativeBuildError(f"building {name} in {build_dir} failed: {exc}") from exc
    finally:
        logger.setLevel(level)
    return Path(path)


# ------------------------------------------------------------------------------ CPU kernels
@dataclass(frozen=True)
class CpuBuildPlan:
    """What :func:`build_cpu` compiles (one C++ file, no CUDA), with which flags, where."""

    sources: tuple[Path, ...]
    build_dir: Path
    cxx_flags: tuple[str, ...]

    @property
    def library(self) -> Path:
        return self.build_dir / f"{CPU_EXTENSION_NAME}.so"


def cpu_cxx_flags() -> tuple[str, ...]:
    """The compiler flags of the CPU kernels on this platform."""
    return CPU_MSVC_FLAGS if sys.platform == "win32" else CPU_CXX_FLAGS


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
        build_dir = cache_root() / _safe(tag)
    return CpuBuildPlan(
        sources=tuple(src / name for name in CPU_SOURCES),
        build_dir=Path(build_dir),
        cxx_flags=flags,
    )


def build_cpu(plan: CpuBuildPlan, verbose: bool = False) -> Path:
    """Compile and link the CPU kernels (a no-op when cached) and load the library."""
    return _compile(
        CPU_EXTENSION_NAME,
        plan.sources,
        plan.build_dir,
        plan.cxx_flags,
        (),
        with_cuda=False,
        verbose=verbose,
    )


def _ninja_from_pip() -> bool:
    """Whether the ``ninja`` pip package provides the binary (it need not be on PATH)."""
    if importlib.util.find_spec("ninja") is None:
        return False
    import ninja  # type: ignore[import-not-found]

    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and (Path(bin_dir) / "ninja").is_file():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False


def timed_build(plan: BuildPlan, verbose: bool = False) -> tuple[Path, float]:
    """:func:`build`, and the seconds it took."""
    start = time.perf_counter()
    path = build(plan, verbose=verbose)
    return path, time.perf_counter() - start
