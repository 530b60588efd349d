"""act_mm: the OpenMMLab adapter of ACT (activation-compressed training for PyTorch).

``import act_mm`` (or ``custom_imports = dict(imports=['act_mm'])`` in a config) registers
actcore's Q-layers in mmengine's root ``MODELS`` registry under the names that
``conv_cfg`` / ``norm_cfg`` / ``act_cfg`` use (``QConv2d``, ``QBN``, ``QReLU``, ... see
:data:`act_mm.registry.REGISTERED`), and :class:`ACTConvertHook` in ``HOOKS``, which
converts a runner's whole model from one ``custom_hooks`` entry. Importing again is a
no-op.
"""

from __future__ import annotations

from . import layers
from .hooks import ACTConvertHook

# the builder-convention Q-layers: everything act_mm.layers exports is act_mm's own
from .layers import *  # noqa: F403
from .registry import REGISTERED, register_layers
from .train import config_path, shipped_configs

__version__ = "0.1.0"

register_layers()

__all__ = [
    "REGISTERED",
    "ACTConvertHook",
    "__version__",
    "config_path",
    "register_layers",
    "shipped_configs",
]
__all__ += layers.__all__
