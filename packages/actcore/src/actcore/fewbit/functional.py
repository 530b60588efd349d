"""Few-bit activations as functionals, with torch's signatures plus ``bits``.

Continuous activations keep a ``bits``-bit (1..4, default 3) code per element for backward
and use the optimal table of :mod:`actcore.fewbit.tables`. Piecewise-linear ones (relu,
leaky_relu, threshold, hardsigmoid, hardtanh, relu6, hardshrink, softshrink) have a
two-valued derivative: they keep 1 bit per element and their gradient equals torch's,
kinks included; their ``bits`` is accepted (and checked) for a uniform signature only.
The forward output is always torch's, bitwise. With ``inplace=True`` the input is
overwritten as in torch (its codes are taken first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .function import MaskCode, TableCode, apply
from .tables import check_bits, get_table

__all__ = [
    "DEFAULT_BITS",
    "celu",
    "elu",
    "gelu",
    "hardshrink",
    "hardsigmoid",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "logsigmoid",
    "mish",
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
]

DEFAULT_BITS = 3


@functools.cache
def _table_code(name: str, bits: int, params: tuple[tuple[str, Any], ...]) -> TableCode:
    return TableCode(get_table(name, bits, **dict(params)))


def _continuous(
    x: Tensor,
    name: str,
    forward: Callable[[Tensor], Tensor],
    bits: int,
    inplace: bool = False,
    **params: Any,
) -> Tensor:
    bits = check_bits(bits)
    key = tuple(sorted(params.items()))
    return apply(x, forward, lambda: _table_code(name, bits, key), inplace=inplace)


# Piecewise-linear: each predicate is torch's backward branch condition and selects
# levels[1]. As in torch's CPU kernels, threshold and hardtanh compare half inputs in
# float32 and the shrinks in the input dtype (this matters only for parameters that a half
# type cannot represent). NaN inputs may get another gradient than torch's, whose own result
# for NaN depends on whether its kernel takes the vectorised path. Codes are memoised per
# parameters, so their level tensors are reused.
_ONE_SIXTH_F32 = float(np.float32(1.0) / np.float32(6.0))  # torch's constant, for every dtype
_Mask = tuple[Callable[[Tensor], Tensor], tuple[float, float], bool]
_MASKS: dict[str, Callable[..., _Mask]] = {
    "relu": lambda: (lambda x: x <= 0, (1.0, 0.0), False),
    "leaky_relu": lambda slope: (lambda x: x > 0, (slope, 1.0), False),
    "threshold": lambda th: (lambda x: x <= th, (1.0, 0.0), True),
    "hardtanh": lambda lo, hi: (lambda x: (x <= lo) | (x >= hi), (1.0, 0.0), True),
    "relu6": lambda: (lambda x: (x <= 0) | (x >= 6), (1.0, 0.0), False),
    "hardsigmoid": lambda: (lambda x: (x > -3) & (x < 3), (0.0, _ONE_SIXTH_F32), False),
    "shrink": lambda lambd: (lambda x: (x >= -lambd) & (x <= lambd), (1.0, 0.0), False),
}


@functools.cache
def _mask_code(kind: str, *params: float) -> MaskCode:
    predicate, levels, upcast = _MASKS[kind](*params)
    return MaskCode(predicate, levels, upcast_half=upcast)


def _piecewise(
    x: Tensor,
    forward: Callable[[Tensor], Tensor],
    bits: int,
    kind: str,
    *params: float,
    inplace: bool = False,
) -> Tensor:
    check_bits(bits)
    return apply(x, forward, lambda: _mask_code(kind, *params), inplace=inplace)


def relu(input: Tensor, inplace: bool = False, bits: int = 1) -> Tensor:
    """:func:`torch.nn.functional.relu`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.relu, inplace=inplace)
    return _piecewise(input, fwd, bits, "relu", inplace=inplace)


def leaky_relu(
    input: Tensor, negative_slope: float = 0.01, inplace: bool = False, bits: int = 1
) -> Tensor:
    """:func:`torch.nn.functional.leaky_relu`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.leaky_relu, negative_slope=negative_slope, inplace=inplace)
    return _piecewise(input, fwd, bits, "leaky_relu", negative_slope, inplace=inplace)


def threshold(
    input: Tensor, threshold: float, value: float, inplace: bool = False, bits: int = 1
) -> Tensor:
    """:func:`torch.nn.functional.threshold`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.threshold, threshold=threshold, value=value, inplace=inplace)
    return _piecewise(input, fwd, bits, "threshold", threshold, inplace=inplace)


def hardtanh(
    input: Tensor,
    min_val: float = -1.0,
    max_val: float = 1.0,
    inplace: bool = False,
    bits: int = 1,
) -> Tensor:
    """:func:`torch.nn.functional.hardtanh`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.hardtanh, min_val=min_val, max_val=max_val, inplace=inplace)
    return _piecewise(input, fwd, bits, "hardtanh", min_val, max_val, inplace=inplace)


def relu6(input: Tensor, inplace: bool = False, bits: int = 1) -> Tensor:
    """:func:`torch.nn.functional.relu6`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.relu6, inplace=inplace)
    return _piecewise(input, fwd, bits, "relu6", inplace=inplace)


def hardsigmoid(input: Tensor, inplace: bool = False, bits: int = 1) -> Tensor:
    """:func:`torch.nn.functional.hardsigmoid`; gradient exact from 1 bit per element."""
    fwd = functools.partial(F.hardsigmoid, inplace=inplace)
    return _piecewise(input, fwd, bits, "hardsigmoid", inplace=inplace)


def hardshrink(input: Tensor, lambd: float = 0.5, bits: int = 1) -> Tensor:
    """:func:`torch.nn.functional.hardshrink`; gradient exact from 1 bit per element."""
    return _piecewise(input, functools.partial(F.hardshrink, lambd=lambd), bits, "shrink", lambd)


def softshrink(input: Tensor, lambd: float = 0.5, bits: int = 1) -> Tensor:
    """:func:`torch.nn.functional.softshrink`; gradient exact from 1 bit per element."""
    return _piecewise(input, functools.partial(F.softshrink, lambd=lambd), bits, "shrink", lambd)


# Continuous: optimal piecewise-constant derivative tables.


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False, bits: int = DEFAULT_BITS):
    """:func:`torch.nn.functional.celu` with a ``bits``-bit derivative."""
    fwd = functools.partial(F.celu, alpha=alpha, inplace=inplace)
    return _continuous(input, "celu", fwd, bits, inplace, alpha=alpha)


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False, bits: int = DEFAULT_BITS):
    """:func:`torch.nn.functional.elu` with a ``bits``-bit derivative."""
    fwd = functools.partial(F.elu, alpha=alpha, inplace=inplace)
    return _continuous(input, "elu", fwd, bits, inplace, alpha=alpha)


def gelu(input: Tensor, approximate: str = "none", bits: int = DEFAULT_BITS) -> Tensor:
    """:func:`torch.nn.functional.gelu` (exact or ``approximate='tanh'``), ``bits``-bit
    derivative."""
    fwd = functools.partial(F.gelu, approximate=approximate)
    return _continuous(input, "gelu", fwd, bits, approximate=approximate)


def softplus(
    input: Tensor, beta: float = 1.0, threshold: float = 20.0, bits: int = DEFAULT_BITS
) -> Tensor:
    """:func:`torch.nn.functional.softplus` with a ``bits``-bit derivative."""
    fwd = functools.partial(F.softplus, beta=beta, threshold=threshold)
    return _continuous(input, "softplus", fwd, bits, beta=beta, threshold=threshold)


# Continuous, with no parameter but ``inplace`` (or none): one definition for each kind.


def _with_inplace(name: str, forward: Callable[..., Tensor], doc: str) -> Callable[..., Tensor]:
    def activation(input: Tensor, inplace: bool = False, bits: int = DEFAULT_BITS) -> Tensor:
        fwd = functools.partial(forward, inplace=inplace)
        return _continuous(input, name, fwd, bits, inplace)

    return _named(activation, name, doc)


def _plain(name: str, forward: Callable[[Tensor], Tensor], doc: str) -> Callable[..., Tensor]:
    def activation(input: Tensor, bits: int = DEFAULT_BITS) -> Tensor:
        return _continuous(input, name, forward, bits)

    return _named(activation, name, doc)


def _named(fn: Callable[..., Tensor], name: str, doc: str) -> Callable[..., Tensor]:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f":func:`{doc}` with a ``bits``-bit derivative."
    return fn


hardswish = _with_inplace("hardswish", F.hardswish, "torch.nn.functional.hardswish")
logsigmoid = _plain("logsigmoid", F.logsigmoid, "torch.nn.functional.logsigmoid")
mish = _with_inplace("mish", F.mish, "torch.nn.functional.mish")
selu = _with_inplace("selu", F.selu, "torch.nn.functional.selu")
sigmoid = _plain("sigmoid", torch.sigmoid, "torch.sigmoid")
silu = _with_inplace("silu", F.silu, "torch.nn.functional.silu")
softsign = _plain("softsign", F.softsign, "torch.nn.functional.softsign")
tanh = _plain("tanh", torch.tanh, "torch.tanh")
tanhshrink = _plain("tanhshrink", F.tanhshrink, "torch.nn.functional.tanhshrink")
