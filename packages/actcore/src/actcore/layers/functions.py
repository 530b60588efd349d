"""Autograd functions of the Q-layers, in one namespace (each family has its own module).

Each forward computes exactly what the torch layer computes (the same aten op), saves
through :func:`actcore.layers.stash.stash` (which compresses per the layer's level), and each
backward calls the public aten backward op of that layer on the restored tensors:

- :mod:`actcore.layers.conv_functions`: conv, transposed conv, linear;
- :mod:`actcore.layers.norm_functions`: batch, sync batch, layer, group, RMS norm, normalize;
- :mod:`actcore.layers.masked_functions`: the ReLU family and dropout (1-bit masks);
- :mod:`actcore.layers.pool_functions`: max and average pooling;
- :mod:`actcore.layers.double_backward`: what they do in a ``create_graph`` backward.
"""

from __future__ import annotations

from .conv_functions import ConvFunction, LinearFunction, own_output
from .double_backward import (
    guard_input,
    layer_name,
    link,
    no_second_derivative,
    refuse_double_backward,
)
from .masked_functions import (
    DropoutFunction,
    MaskedActivationFunction,
    dropout_backward,
    dropout_with_mask,
    note_dropout_output,
    note_output_mask,
)
from .norm_functions import (
    BatchNormFunction,
    GroupNormFunction,
    LayerNormFunction,
    NormalizeFunction,
    RMSNormFunction,
    SyncBatchNormFunction,
)
from .pool_functions import AvgPoolFunction, MaxPoolFunction

__all__ = [
    "AvgPoolFunction",
    "BatchNormFunction",
    "ConvFunction",
    "DropoutFunction",
    "GroupNormFunction",
    "LayerNormFunction",
    "LinearFunction",
    "MaskedActivationFunction",
    "MaxPoolFunction",
    "NormalizeFunction",
    "RMSNormFunction",
    "SyncBatchNormFunction",
    "dropout_backward",
    "dropout_with_mask",
    "guard_input",
    "layer_name",
    "link",
    "no_second_derivative",
    "note_dropout_output",
    "note_output_mask",
    "own_output",
    "refuse_double_backward",
]
