"""ACT: activation-compressed training for PyTorch (core package).

Packages that add Q-layers for other frameworks build on :mod:`actcore.extend`.
"""

from __future__ import annotations

from . import budget, compressors, fewbit, memory, ops, policies, resume, rng
from .budget import MemoryPlan, fit_budget, max_batch, max_seq
from .config import LEVELS, Config, LevelSpec, config, set_optimization_level
from .controller import Controller
from .convert import ConversionReport, QModule, convert
from .layers import *  # noqa: F403 - the Q-layers are part of the top-level API
from .layers import __all__ as _layer_names
from .layers import stash
from .saved_tensors.hooks import compress_saved_tensors

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "Config",
    "Controller",
    "ConversionReport",
    "LevelSpec",
    "MemoryPlan",
    "QModule",
    "__version__",
    "budget",
    "compress_saved_tensors",
    "compressors",
    "config",
    "convert",
    "fewbit",
    "fit_budget",
    "max_batch",
    "max_seq",
    "memory",
    "ops",
    "policies",
    "resume",
    "rng",
    "set_optimization_level",
    "stash",
    *_layer_names,
]
