"""Q-layers adapted to the calling conventions of OpenMMLab's layer builders.

Most of actcore's Q-layers go into the registry as they are: they subclass the torch
layers, so mmcv's ``build_norm_layer`` already names them ``bn``/``gn``/``ln`` and ResNet's
``norm_eval`` (an ``isinstance(m, _BatchNorm)`` check) still finds them. Three builder
conventions need a thin subclass, defined here (same parameters, buffers and
``state_dict`` keys as the torch layer; forward unchanged):

* ``build_norm_layer(cfg, num_features)`` passes the channel count first for every norm
  type, and only special-cases ``nn.GroupNorm`` itself: :class:`QGN` takes
  ``(num_channels, num_groups, ...)`` by position, both by keyword.
* mmcv's ``ConvModule`` passes ``inplace=`` to every activation but a fixed list of names
  ('GELU', 'Sigmoid', 'Tanh', ...): :class:`QGELU`, :class:`QSigmoid` and :class:`QTanh`
  accept it and ignore it (their torch layers have no in-place form).
* the norm classes carry mmcv's ``_abbr_`` explicitly, so the abbreviation never depends
  on class-name inference.

One more class follows mmengine itself: a ``Runner`` that is not distributed replaces every
``SyncBatchNorm`` (``QSyncBN`` included) by mmengine's ``_BatchNormXd``. :class:`QBatchNormXd`
is its Q-layer, registered with :func:`actcore.layers.register_q_layer`, so
``ACTConvertHook`` (which runs after that replacement) compresses those layers again.
"""

from __future__ import annotations

from typing import Any

from mmengine.model.utils import _BatchNormXd

from actcore import (
    QBatchNorm1d,
    QBatchNorm2d,
    QBatchNorm3d,
    QBatchNormBase,
    QGroupNorm,
    QLayerNorm,
    QSyncBatchNorm,
    fewbit,
)
from actcore.extend import FEWBIT_DEFAULT_BITS as DEFAULT_BITS
from actcore.extend import register_q_layer

__all__ = [
    "QGELU",
    "QGN",
    "QLN",
    "QBN1d",
    "QBN2d",
    "QBN3d",
    "QBatchNormXd",
    "QSigmoid",
    "QSyncBN",
    "QTanh",
]


class QBN1d(QBatchNorm1d):
    """:class:`actcore.QBatchNorm1d` with mmcv's abbreviation (``bn``)."""

    _abbr_ = "bn"


class QBN2d(QBatchNorm2d):
    """:class:`actcore.QBatchNorm2d` with mmcv's abbreviation (``bn``)."""

    _abbr_ = "bn"


class QBN3d(QBatchNorm3d):
    """:class:`actcore.QBatchNorm3d` with mmcv's abbreviation (``bn``)."""

    _abbr_ = "bn"


class QLN(QLayerNorm):
    """:class:`actcore.QLayerNorm` with mmcv's abbreviation (``ln``)."""

    _abbr_ = "ln"


class QGN(QGroupNorm):
    """:class:`actcore.QGroupNorm` built the way ``build_norm_layer`` builds norm layers.

    ``QGN(num_channels, num_groups=32)`` (``build_norm_layer`` passes the channel count
    first); keywords ``num_groups=`` / ``num_channels=`` work as for ``nn.GroupNorm``.
    """

    _abbr_ = "gn"

    def __init__(self, num_channels: int, num_groups: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_groups, num_channels, *args, **kwargs)


class QSyncBN(QSyncBatchNorm):
    """:class:`actcore.QSyncBatchNorm` with mmcv's abbreviation (``bn``)."""

    _abbr_ = "bn"


class QBatchNormXd(QBatchNormBase, _BatchNormXd):
    """Compressed mmengine ``_BatchNormXd`` (what a single-process Runner makes of SyncBN)."""

    _abbr_ = "bn"


register_q_layer(_BatchNormXd, QBatchNormXd)


class QGELU(fewbit.GELU):
    """Few-bit GELU (:class:`actcore.fewbit.GELU`); ``inplace`` is accepted and ignored."""

    def __init__(self, approximate: str = "none", bits: int = DEFAULT_BITS, inplace: bool = False):
        super().__init__(approximate=approximate, bits=bits)


class QSigmoid(fewbit.Sigmoid):
    """Few-bit Sigmoid (:class:`actcore.fewbit.Sigmoid`); ``inplace`` is accepted and ignored."""

    def __init__(self, bits: int = DEFAULT_BITS, inplace: bool = False) -> None:
        super().__init__(bits=bits)


class QTanh(fewbit.Tanh):
    """Few-bit Tanh (:class:`actcore.fewbit.Tanh`); ``inplace`` is accepted and ignored."""

    def __init__(self, bits: int = DEFAULT_BITS, inplace: bool = False) -> None:
        super().__init__(bits=bits)
