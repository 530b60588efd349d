"""FewBit: few-bit activation derivatives, randomized linear layers, model surgery.

* Activations (modules and functionals with torch's signatures plus ``bits``): the forward
  output is torch's, bitwise; backward multiplies the output gradient by a piecewise-constant
  derivative whose piece index is kept packed at ``bits`` bits per element.

  - piecewise-linear, exact gradient from 1 bit: ``relu``, ``leaky_relu``, ``threshold``,
    ``hardsigmoid``, ``hardtanh``, ``relu6``, ``hardshrink``, ``softshrink``;
  - continuous, ``bits`` in 1..4 (default 3), optimal tables in the weighted L2 sense under
    N(0, 1) (:mod:`actcore.fewbit.tables`; ``python -m actcore.fewbit --write`` regenerates
    the shipped ones): ``celu``, ``elu``, ``gelu`` (exact and tanh), ``hardswish``,
    ``logsigmoid``, ``mish``, ``selu``, ``sigmoid``, ``silu``, ``softplus``, ``softsign``,
    ``tanh``, ``tanhshrink``.

* :class:`RandomizedLinear`: an ``nn.Linear`` with an unbiased random-projection weight
  gradient that keeps ``proj_ratio`` of the input rows.
* :func:`map_module`, :func:`convert_linear`: rebuild a model in place.

Example::

    import actcore.fewbit as fewbit
    mlp = nn.Sequential(nn.Linear(768, 3072), fewbit.GELU(bits=3), nn.Linear(3072, 768))
    mlp = fewbit.convert_linear(mlp, fewbit.RandomizedLinear, proj_ratio=0.2)
"""

from __future__ import annotations

from . import functional, modules
from .convert import convert_linear, map_module
from .function import MaskCode, TableCode, apply

# the activations: everything the functionals and the modules export is fewbit's own
from .functional import *  # noqa: F403
from .modules import *  # noqa: F403
from .optimal import NORMAL, Distribution, normal, uniform
from .randomized import RandomizedLinear, randomized_linear
from .tables import Table, compute_tables, get_table

__all__ = [
    "NORMAL",
    "Distribution",
    "MaskCode",
    "RandomizedLinear",
    "Table",
    "TableCode",
    "apply",
    "compute_tables",
    "convert_linear",
    "get_table",
    "map_module",
    "normal",
    "randomized_linear",
    "uniform",
]
__all__ += functional.__all__
__all__ += modules.__all__
