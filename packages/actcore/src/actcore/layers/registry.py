"""``Q_LAYERS``, which torch layer :func:`actcore.convert` turns into which Q-layer, and
:func:`register_q_layer`, which adds other libraries' layers to it."""

from __future__ import annotations

from torch import nn

from .base import QLayer
from .conv import (
    QConv1d,
    QConv2d,
    QConv3d,
    QConvTranspose1d,
    QConvTranspose2d,
    QConvTranspose3d,
    QLinear,
)
from .masked import QDropout, QHardtanh, QLeakyReLU, QReLU, QReLU6
from .norm import (
    QBatchNorm1d,
    QBatchNorm2d,
    QBatchNorm3d,
    QGroupNorm,
    QLayerNorm,
    QRMSNorm,
    QSyncBatchNorm,
)
from .pool import QAvgPool1d, QAvgPool2d, QAvgPool3d, QMaxPool1d, QMaxPool2d, QMaxPool3d

__all__ = ["Q_LAYERS", "register_q_layer"]

# torch layer -> Q-layer, most specific first (ReLU6 before Hardtanh)
Q_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: QConv1d,
    nn.Conv2d: QConv2d,
    nn.Conv3d: QConv3d,
    nn.ConvTranspose1d: QConvTranspose1d,
    nn.ConvTranspose2d: QConvTranspose2d,
    nn.ConvTranspose3d: QConvTranspose3d,
    nn.Linear: QLinear,
    nn.BatchNorm1d: QBatchNorm1d,
    nn.BatchNorm2d: QBatchNorm2d,
    nn.BatchNorm3d: QBatchNorm3d,
    nn.SyncBatchNorm: QSyncBatchNorm,
    nn.LayerNorm: QLayerNorm,
    nn.GroupNorm: QGroupNorm,
    nn.RMSNorm: QRMSNorm,
    nn.ReLU: QReLU,
    nn.LeakyReLU: QLeakyReLU,
    nn.ReLU6: QReLU6,
    nn.Hardtanh: QHardtanh,
    nn.Dropout: QDropout,
    nn.MaxPool1d: QMaxPool1d,
    nn.MaxPool2d: QMaxPool2d,
    nn.MaxPool3d: QMaxPool3d,
    nn.AvgPool1d: QAvgPool1d,
    nn.AvgPool2d: QAvgPool2d,
    nn.AvgPool3d: QAvgPool3d,
}


def register_q_layer(stock: type[nn.Module], q_layer: type[nn.Module]) -> None:
    """Make :func:`actcore.convert` turn ``stock`` modules (that exact type) into ``q_layer``.

    For layer classes of other libraries (e.g. mmengine's ``_BatchNormXd``). ``q_layer``
    must subclass both ``stock`` and :class:`QLayer` and add no parameters or buffers of
    its own: convert swaps the class of the existing module in place. Registering the
    same pair again is a no-op; another Q-layer for an already mapped ``stock`` is an error.
    """
    for name, cls in (("stock", stock), ("q_layer", q_layer)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register_q_layer: {name} must be an nn.Module class, got {cls!r}")
    if not (issubclass(q_layer, stock) and issubclass(q_layer, QLayer)):
        raise TypeError(
            f"register_q_layer: {q_layer.__name__} must subclass both "
            f"{stock.__name__} and actcore.layers.QLayer"
        )
    known = Q_LAYERS.get(stock)
    reloaded = known is not None and (known.__module__, known.__qualname__) == (
        q_layer.__module__,
        q_layer.__qualname__,
    )  # the same class from a reloaded module replaces its old self
    if known is not None and known is not q_layer and not reloaded:
        raise ValueError(f"register_q_layer: {stock.__name__} already converts to {known.__name__}")
    Q_LAYERS[stock] = q_layer
