"""The CUDA toolkit that builds the kernels: found from ``$CUDA_HOME``/``$CUDA_PATH``, the
root the ``nvcc`` on ``PATH`` reports, or the usual locations; checked against torch's CUDA;
and the headers of the NVIDIA pip wheels that torch's CUDA libraries come from."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import NativeBuildError

__all__ = ["CudaToolkit", "check_torch_cuda", "find_cuda_toolkit", "wheel_include_dirs"]


@dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit: its root (``bin/nvcc``, ``include/``), nvcc's version, how found."""

    root: Path
    version: str
    found_by: str

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"


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
