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

from .convert import convert_linear, map_module
from .function import MaskCode, TableCode, apply
from .functional import (
    DEFAULT_BITS,
    celu,
    elu,
    gelu,
    hardshrink,
    hardsigmoid,
    hardswish,
    hardtanh,
    leaky_relu,
    logsigmoid,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    softplus,
    softshrink,
    softsign,
    tanh,
    tanhshrink,
    threshold,
)
from .modules import (
    CELU,
    ELU,
    GELU,
    SELU,
    Hardshrink,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    LeakyReLU,
    LogSigmoid,
    Mish,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softplus,
    Softshrink,
    Softsign,
    Tanh,
    Tanhshrink,
    Threshold,
)
from .optimal import NORMAL, Distribution, normal, uniform
from .randomized import RandomizedLinear, randomized_linear
from .tables import Table, compute_tables, get_table

__all__ = [
    "CELU",
    "DEFAULT_BITS",
    "ELU",
    "GELU",
    "NORMAL",
    "SELU",
    "Distribution",
    "Hardshrink",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "LeakyReLU",
    "LogSigmoid",
    "MaskCode",
    "Mish",
    "RandomizedLinear",
    "ReLU",
    "ReLU6",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Softshrink",
    "Softsign",
    "Table",
    "TableCode",
    "Tanh",
    "Tanhshrink",
    "Threshold",
    "apply",
    "celu",
    "compute_tables",
    "convert_linear",
    "elu",
    "gelu",
    "get_table",
    "hardshrink",
    "hardsigmoid",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "logsigmoid",
    "map_module",
    "mish",
    "normal",
    "randomized_linear",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "softplus",
    "softshrink",
    "softsign",
    "tanh",
    "tanhshrink",
    "threshold",
    "uniform",
]
