"""The extension API: what a package that adds Q-layers for another framework builds on.

``act-hf``, ``act-pyg`` and ``act-mm`` import from ``actcore`` and from this module only
(a test reads their imports), so the core's internal layout can change under them. An
extension does three things, each with the names here:

* **a Q-layer** for a module class: subclass :class:`QLayer` (a module class with a
  ``from_module`` constructor) or :class:`ConvertedLayer` (a module converted in place),
  register it with :func:`register_q_layer`, and ``actcore.convert`` swaps it in;
* **its autograd function** keeps compressed tensors for backward: :func:`choose` picks the
  compressor for a tensor of a role (:data:`CONV` for a linear map's input) at the layer's
  level (:func:`layer_spec`), :func:`stash` packs them on ``ctx`` and :func:`unstash`
  restores them in backward, where :func:`observe` hands the output gradient to the
  layer's adaptive scheme; :func:`needs_saving` says whether a forward saves at all;
  :func:`guard_input` and :func:`own_output` keep autograd's version checks, and
  :func:`call_outside_modes` runs a plain call inside a routed forward;
* **a level**: an entry point takes a level name or a :class:`LevelSpec` and resolves it
  once with :func:`level_spec`, then passes the spec on.

A converted layer's bits may come from a :class:`Scheme` set as its ``act_scheme``
(actcore's adaptive bits and policies are two): :func:`choose` asks it for each saved
tensor's compressor, and backward hands it the layer's output gradient.

Smooth activations with few-bit derivative codes register with :func:`register_activation`
(their derivative tables: :func:`get_table`, :class:`TableCode`, :func:`apply_code`);
functions whose backward reruns their forward from the compressed input register with
:func:`register_recomputed`.
"""

from __future__ import annotations

from .compressors import IDENTITY, Compressor, Quantize, Swap
from .config import LEVELS, LevelSpec, config, level_spec
from .convert import default_fewbit_bits
from .fewbit import TableCode, get_table
from .fewbit import apply as apply_code
from .fewbit.convert import register_activation
from .fewbit.functional import DEFAULT_BITS as FEWBIT_DEFAULT_BITS
from .fewbit.tables import MAX_BITS as FEWBIT_MAX_BITS
from .layers import ConvertedLayer, QLayer, register_q_layer
from .layers.functions import (
    LinearFunction,
    dropout_backward,
    dropout_with_mask,
    guard_input,
    own_output,
)
from .layers.modules import LOWER_PRECISION, autocast_inputs
from .layers.recompute import register_recomputed
from .layers.roles import CONV
from .layers.stash import Scheme, choose, layer_spec, needs_saving, observe, stash, unstash
from .ops.api import check_bits
from .saved_tensors.op_mode import call_outside_modes
from .walker import Exclude

__all__ = [
    "CONV",
    "FEWBIT_DEFAULT_BITS",
    "FEWBIT_MAX_BITS",
    "IDENTITY",
    "LEVELS",
    "LOWER_PRECISION",
    "Compressor",
    "ConvertedLayer",
    "Exclude",
    "LevelSpec",
    "LinearFunction",
    "QLayer",
    "Quantize",
    "Scheme",
    "Swap",
    "TableCode",
    "apply_code",
    "autocast_inputs",
    "call_outside_modes",
    "check_bits",
    "choose",
    "config",
    "default_fewbit_bits",
    "dropout_backward",
    "dropout_with_mask",
    "get_table",
    "guard_input",
    "layer_spec",
    "level_spec",
    "needs_saving",
    "observe",
    "own_output",
    "register_activation",
    "register_q_layer",
    "register_recomputed",
    "stash",
    "unstash",
]
