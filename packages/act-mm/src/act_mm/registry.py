"""Register actcore's Q-layers in mmengine's root ``MODELS`` registry.

The root registry is the parent of every OpenMMLab scope (mmdet, mmseg, mmpretrain, ...),
and mmcv's ``build_conv_layer`` / ``build_norm_layer`` / ``build_activation_layer`` fall
back to it, so ``conv_cfg=dict(type='QConv2d')``, ``norm_cfg=dict(type='QBN')`` and
``act_cfg=dict(type='QReLU')`` work in any stock config once ``act_mm`` is imported.
"""

from __future__ import annotations

from collections.abc import Mapping

from mmengine.registry import MODELS, Registry
from torch import nn

import actcore
from actcore import fewbit

from . import layers as mm_layers


def _table() -> dict[str, type[nn.Module]]:
    """Registered name -> class."""
    conv = {
        "QConv1d": actcore.QConv1d,
        "QConv2d": actcore.QConv2d,
        "QConv3d": actcore.QConv3d,
        "QConv": actcore.QConv2d,  # as mmcv's 'Conv' is nn.Conv2d
        "QConvTranspose1d": actcore.QConvTranspose1d,
        "QConvTranspose2d": actcore.QConvTranspose2d,
        "QConvTranspose3d": actcore.QConvTranspose3d,
        "QLinear": actcore.QLinear,
    }
    norm = {
        "QBN": mm_layers.QBN2d,  # as mmcv's 'BN' is nn.BatchNorm2d
        "QBN1d": mm_layers.QBN1d,
        "QBN2d": mm_layers.QBN2d,
        "QBN3d": mm_layers.QBN3d,
        "QSyncBN": mm_layers.QSyncBN,
        "QGN": mm_layers.QGN,
        "QLN": mm_layers.QLN,
        # actcore's own class names, with torch's constructors
        "QBatchNorm1d": actcore.QBatchNorm1d,
        "QBatchNorm2d": actcore.QBatchNorm2d,
        "QBatchNorm3d": actcore.QBatchNorm3d,
        "QSyncBatchNorm": actcore.QSyncBatchNorm,
        "QGroupNorm": actcore.QGroupNorm,
        "QLayerNorm": actcore.QLayerNorm,
    }
    activation = {
        "QReLU": actcore.QReLU,
        "QLeakyReLU": actcore.QLeakyReLU,
        "QReLU6": actcore.QReLU6,
        "QHardtanh": actcore.QHardtanh,
        # few-bit activation derivatives (actcore.fewbit)
        "QGELU": mm_layers.QGELU,
        "QSiLU": fewbit.SiLU,
        "QSwish": fewbit.SiLU,  # mmcv's 'Swish' is x * sigmoid(x), i.e. SiLU
        "QSigmoid": mm_layers.QSigmoid,
        "QTanh": mm_layers.QTanh,
        "QHSwish": fewbit.Hardswish,
        "QHardswish": fewbit.Hardswish,
        "QELU": fewbit.ELU,
        "QMish": fewbit.Mish,
    }
    other = {
        "QDropout": actcore.QDropout,
        "QMaxPool1d": actcore.QMaxPool1d,
        "QMaxPool2d": actcore.QMaxPool2d,
        "QMaxPool3d": actcore.QMaxPool3d,
        "QAvgPool1d": actcore.QAvgPool1d,
        "QAvgPool2d": actcore.QAvgPool2d,
        "QAvgPool3d": actcore.QAvgPool3d,
    }
    return {**conv, **norm, **activation, **other}


#: Every name ``import act_mm`` registers in ``mmengine.registry.MODELS``, with its class.
REGISTERED: Mapping[str, type[nn.Module]] = _table()


def _ours(obj: object) -> bool:
    module = getattr(obj, "__module__", "") or ""
    return module.split(".")[0] in ("act_mm", "actcore")


def register_layers(registry: Registry = MODELS) -> list[str]:
    """Register :data:`REGISTERED` in ``registry``; idempotent. Returns the names added.

    A name already bound to the same class is skipped; one bound to an act_mm/actcore class
    from an earlier import (e.g. after ``importlib.reload``) is replaced; a name another
    package registered raises mmengine's ``KeyError`` naming both.
    """
    added = []
    for name, cls in REGISTERED.items():
        existing = registry.module_dict.get(name)
        if existing is cls:
            continue
        if existing is not None and not _ours(existing):
            raise KeyError(
                f"{name} is already registered in {registry.name} by "
                f"{existing.__module__}.{existing.__qualname__}; act_mm cannot register "
                f"{cls.__module__}.{cls.__qualname__} under that name"
            )
        registry.register_module(name=name, module=cls, force=existing is not None)
        added.append(name)
    return added
