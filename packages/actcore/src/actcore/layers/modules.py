"""Q-layers: drop-in subclasses of torch's layers that save compressed activations.

Each subclasses its torch counterpart (same constructor, parameters, buffers and
``state_dict`` keys; ``isinstance`` still holds) and computes the same forward output.
Without a pending backward (``torch.no_grad``, nothing requires grad) or at a level that
keeps this layer's tensors as they are, it *is* the torch layer: no extra work at all.
``act_level`` (None: the process-wide level) selects the level per layer.

This module gathers the Q-layers' API in one namespace (re-exported by
:mod:`actcore.layers` and :mod:`actcore`); each family has its own module:
:mod:`~actcore.layers.base` (``QLayer``), :mod:`~actcore.layers.conv` (conv, transposed
conv, linear), :mod:`~actcore.layers.norm`, :mod:`~actcore.layers.masked` (ReLU family,
dropout), :mod:`~actcore.layers.pool`, :mod:`~actcore.layers.registry` (``Q_LAYERS``),
and :mod:`~actcore.layers.autocast` (``LOWER_PRECISION``, ``autocast_inputs``, which serve
:mod:`actcore.layers.routing` and the adapters).
"""

from __future__ import annotations

from . import base, conv, masked, norm, pool, registry
from .autocast import LOWER_PRECISION as LOWER_PRECISION
from .autocast import autocast_inputs as autocast_inputs
from .base import *  # noqa: F403
from .conv import *  # noqa: F403
from .masked import *  # noqa: F403
from .norm import *  # noqa: F403
from .pool import *  # noqa: F403
from .registry import *  # noqa: F403

# the Q-layers' API, re-exported by actcore.layers and actcore; LOWER_PRECISION and
# autocast_inputs (importable from here, not star-exported) serve the adapters
__all__ = [
    *base.__all__,
    *conv.__all__,
    *masked.__all__,
    *norm.__all__,
    *pool.__all__,
    *registry.__all__,
]
