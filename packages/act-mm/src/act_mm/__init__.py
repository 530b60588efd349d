"""act_mm: the OpenMMLab adapter of ACT (activation-compressed training for PyTorch).

``import act_mm`` (or ``custom_imports = dict(imports=['act_mm'])`` in a config) registers
actcore's Q-layers in mmengine's root ``MODELS`` registry under the names that
``conv_cfg`` / ``norm_cfg`` / ``act_cfg`` use (``QConv2d``, ``QBN``, ``QReLU``, ... see
:data:`act_mm.registry.REGISTERED`), and :class:`ACTConvertHook` in ``HOOKS``, which
converts a runner's whole model from one ``custom_hooks`` entry. Importing again is a
no-op.
"""

from __future__ import annotations

from .hooks import ACTConvertHook
from .layers import (
    QGELU,
    QGN,
    QLN,
    QBatchNormXd,
    QBN1d,
    QBN2d,
    QBN3d,
    QSigmoid,
    QSyncBN,
    QTanh,
)
from .registry import REGISTERED, register_layers
from .train import config_path, shipped_configs

__version__ = "0.1.0"

register_layers()

__all__ = [
    "QGELU",
    "QGN",
    "QLN",
    "REGISTERED",
    "ACTConvertHook",
    "QBN1d",
    "QBN2d",
    "QBN3d",
    "QBatchNormXd",
    "QSigmoid",
    "QSyncBN",
    "QTanh",
    "__version__",
    "config_path",
    "register_layers",
    "shipped_configs",
]
