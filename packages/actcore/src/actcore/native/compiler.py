"""What the CUDA and the CPU builds share: finding the C++/CUDA sources, the cache directory,
and compiling a library (not a Python module) with ``torch.utils.cpp_extension`` and ninja."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from .errors import NativeBuildError

__all__ = ["cache_root"]


def find_sources(names: Sequence[str]) -> Path:
    here = Path(__file__).resolve().parent
    candidates = [here / "csrc", *(parent / "csrc" for parent in here.parents)]
    for candidate in candidates:
        if all((candidate / name).is_file() for name in names):
            return candidate
    raise NativeBuildError(
        f"actcore's C++/CUDA sources ({', '.join(names)}) were not found in "
        f"{here / 'csrc'} nor in a csrc/ directory above it; reinstall actcore"
    )


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/actcore/native``, by default ``~/.cache/actcore/native``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actcore" / "native"


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def compile_library(
    name: str,
    sources: Sequence[Path],
    build_dir: Path,
    cxx_flags: Sequence[str],
    cuda_flags: Sequence[str],
    *,
    with_cuda: bool,
    verbose: bool,
    ld_flags: Sequence[str] = (),
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
            extra_ldflags=list(ld_flags),
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
