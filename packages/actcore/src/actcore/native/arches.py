"""The GPU architectures the CUDA kernels are compiled for: parsed from text, found on the
visible GPUs, and turned into ``-gencode`` flags (so torch never probes for a GPU)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

__all__ = ["DEFAULT_ARCH", "arch_label", "default_arches", "gencode_flags", "parse_arches"]

DEFAULT_ARCH = "9.0"
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


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
