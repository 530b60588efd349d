"""ACT: activation-compressed training for PyTorch (core package)."""

from __future__ import annotations

import importlib
from typing import Any

from . import compressors, ops, policies, resume, rng, stash
from .config import LEVELS, Config, LevelSpec, config, set_optimization_level
from .controller import Controller
from .convert import ConversionReport, QModule, convert
from .layers import *  # noqa: F403 - the Q-layers are part of the top-level API
from .layers import __all__ as _layer_names
from .saved_tensor_hooks import compress_saved_tensors

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "Config",
    "Controller",
    "ConversionReport",
    "LevelSpec",
    "QModule",
    "__version__",
    "compress_saved_tensors",
    "compressors",
    "config",
    "convert",
    "ops",
    "policies",
    "resume",
    "rng",
    "set_optimization_level",
    "stash",
    *_layer_names,
]

_RENAMED = {"engine": "stash", "hooks": "saved_tensor_hooks"}  # deprecated module names


def __getattr__(name: str) -> Any:
    """``actcore.engine`` and ``actcore.hooks``: deprecated aliases of the renamed modules
    (importing them warns with a DeprecationWarning naming the new module)."""
    if name in _RENAMED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
