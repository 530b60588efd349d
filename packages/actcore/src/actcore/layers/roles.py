"""The roles of the tensors a Q-layer keeps, and the bits a level gives each role.

A role says what a tensor is to the backward that reads it: a conv / linear input (read
linearly), a normalization's input, a smooth activation's input or derivative, anything
else. :func:`role_bits` reads a role's bits off a :class:`~actcore.config.LevelSpec`;
:func:`batch_norm_bits` and :data:`NARROW_BITS` raise them where the level's would bias a
gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import LevelSpec

__all__ = [
    "ACTIVATION",
    "BATCH_NORM_BIAS",
    "CONV",
    "DERIVATIVE",
    "EXPANSION",
    "NARROW_BITS",
    "NORM",
    "NORMALIZED",
    "OTHER",
    "ROW_NORM",
    "SCALED_ROLES",
    "batch_norm_bits",
    "expands",
    "role_bits",
]

CONV = "conv"  # inputs of conv / linear layers
NORM = "norm"  # inputs of normalization layers
ROW_NORM = "row_norm"  # inputs of layer / group / RMS norms, F.normalize's unit vectors
ACTIVATION = "activation"  # inputs of smooth activations (their outputs derive from them)
DERIVATIVE = "derivative"  # a smooth activation's derivative f'(x) (config.keep_derivatives)
OTHER = "other"  # anything else the forward saves (the saved-tensor hooks' tensors)
NORMALIZED = ROW_NORM  # (the unit vectors of F.normalize are kept as row-norm inputs)
SCALED_ROLES = frozenset({CONV, ROW_NORM, ACTIVATION, OTHER})
"""Roles whose tensors may carry outlier channels (a batch norm's normalized input has none
by construction; an activation's derivative is bounded). All but CONV are used nonlinearly
in backward (an activation's input is rebuilt into ``f(x)`` and ``f'(x)``), so they keep
their largest channels exact too."""


EXPANSION = 8
"""A linear whose output is at least this many times wider than its input (LoRA's
``lora_B``, a bottleneck adapter's up-projection) keeps its input at :data:`NARROW_BITS`
at least: such an input costs little next to the tensors around it, and its weight
gradient sums few features per token, so rounding noise averages out far less than in a
square layer's."""
NARROW_BITS = 8


def expands(layer: Any) -> bool:
    """Whether ``layer``'s output is at least :data:`EXPANSION` times wider than its input."""
    fan_in, fan_out = getattr(layer, "in_features", 0), getattr(layer, "out_features", 0)
    return isinstance(fan_in, int) and fan_in > 0 and fan_out >= EXPANSION * fan_in


BATCH_NORM_BIAS = 2e-3
"""The largest relative bias a batch norm's input gradient may get from its rounded input
(see :func:`batch_norm_bits`): 0.2%, against tens of percent of rounding noise in one
step's gradient, so the mean over hundreds of steps still sees noise, not bias."""


def batch_norm_bits(x: torch.Tensor) -> int:
    """The fewest bits (1..8) for a batch norm's normalized input ``x`` that keep the bias of
    its input gradient within :data:`BATCH_NORM_BIAS`.

    That gradient is ``x_hat * mean(grad * x_hat)`` (and linear terms) per channel: quadratic
    in the rounded ``x_hat``, so each element's own rounding variance enters it, relative
    size ``var / N`` for ``N`` values per channel. With ``x_hat`` within +-3 and a step of
    ``6 / (2^b - 1)`` (variance at most step^2 / 4), ``2^b - 1 >= 3 / sqrt(N * bias)``: 2
    bits from about 500 values per channel, 5 bits at 16 (a 2x2 map, batch 4).
    """
    n = x.numel() // max(1, x.shape[1]) if x.dim() >= 2 else x.numel()
    levels = 3.0 / math.sqrt(max(1, n) * BATCH_NORM_BIAS)
    return min(8, max(1, math.ceil(math.log2(1.0 + levels))))


def role_bits(spec: LevelSpec, role: str) -> int | None:
    """The bits ``spec`` gives a tensor of ``role`` (None: kept as it is)."""
    if role == CONV:
        return spec.conv_bits
    if role == NORM:
        return spec.norm_bits
    if role == ROW_NORM:
        return spec.row_norm_bits
    if role in (ACTIVATION, DERIVATIVE):
        return spec.activation_bits
    if role == OTHER:
        return spec.other_bits
    raise ValueError(f"unknown role {role!r}")
