"""Derivatives of the continuous activations, in float64 numpy, for building tables.

Each entry gives ``f'(x)`` as torch differentiates ``f`` (the same branch at the kinks), its
parameters with torch's defaults, and its parity. ``even`` marks derivatives with
``f'(-x) = f'(x)`` (``f`` odd up to a constant: sigmoid, tanh, softsign, tanhshrink): their
table is built over ``|x|``, so ``2**bits`` intervals of ``|x|`` act as ``2**(bits+1)``
symmetric intervals of ``x`` at the same storage. Several others are odd about 1/2
(``f' - 1/2`` odd: gelu, silu, softplus, logsigmoid, hardswish); their optimal tables under a
symmetric weight are antisymmetric, which the full dynamic programme finds by itself, so
nothing is folded for them (folding would lose the sign of ``x``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["DERIVATIVES", "Derivative", "canonical_params", "table_key"]

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "none":
        cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
        return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    if approximate == "tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3 * 0.044715 * x * x
        )
    raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")


def _elu(x: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0.0)))


def _celu(x: np.ndarray, alpha: float) -> np.ndarray:
    if alpha == 0:
        raise ValueError("celu alpha must be nonzero, got 0.0")
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0) / alpha))


def _selu(x: np.ndarray) -> np.ndarray:
    return _SELU_SCALE * _elu(x, _SELU_ALPHA)


def _hardswish(x: np.ndarray) -> np.ndarray:
    return np.where(x < -3.0, 0.0, np.where(x <= 3.0, x / 3.0 + 0.5, 1.0))


def _mish(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_softplus(x))
    return t + x * (1.0 - t * t) * _sigmoid(x)


def _softplus_grad(x: np.ndarray, beta: float, threshold: float) -> np.ndarray:
    if beta == 0:
        raise ValueError("softplus beta must be nonzero, got 0.0")
    return np.where(beta * x > threshold, 1.0, _sigmoid(beta * x))


def _sigmoid_grad(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 - s)


def _silu(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@dataclasses.dataclass(frozen=True)
class Derivative:
    """``fn(x, **params)`` is ``f'(x)``; ``defaults`` are torch's default parameters."""

    fn: Callable[..., np.ndarray]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    even: bool = False

    def bind(self, params: Mapping[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
        """``f'`` with ``params`` filled in."""
        return lambda x: self.fn(x, **params)


DERIVATIVES: dict[str, Derivative] = {
    "celu": Derivative(_celu, {"alpha": 1.0}),
    "elu": Derivative(_elu, {"alpha": 1.0}),
    "gelu": Derivative(_gelu, {"approximate": "none"}),
    "hardswish": Derivative(_hardswish),
    "logsigmoid": Derivative(lambda x: _sigmoid(-x)),
    "mish": Derivative(_mish),
    "selu": Derivative(_selu),
    "sigmoid": Derivative(_sigmoid_grad, even=True),
    "silu": Derivative(_silu),
    "softplus": Derivative(_softplus_grad, {"beta": 1.0, "threshold": 20.0}),
    "softsign": Derivative(lambda x: 1.0 / (1.0 + np.abs(x)) ** 2, even=True),
    "tanh": Derivative(lambda x: 1.0 - np.tanh(x) ** 2, even=True),
    "tanhshrink": Derivative(lambda x: np.tanh(x) ** 2, even=True),
}
"""Continuous activations with few-bit derivative tables, by torch functional name."""


def canonical_params(name: str, params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``params`` completed with the defaults, numbers as floats, sorted by name."""
    if name not in DERIVATIVES:
        raise ValueError(f"no derivative table for {name!r}; known: {', '.join(DERIVATIVES)}")
    defaults = DERIVATIVES[name].defaults
    unknown = set(params) - set(defaults)
    if unknown:
        raise TypeError(f"{name} takes parameters {sorted(defaults)}, got {sorted(unknown)}")
    out = []
    for key in sorted(defaults):
        value = params.get(key, defaults[key])
        if isinstance(defaults[key], float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} {key} must be a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{name} {key} must be finite, got {value}")
        out.append((key, value))
    return tuple(out)


def table_key(name: str, params: tuple[tuple[str, Any], ...]) -> str:
    """A readable key: the name, plus the parameters that differ from torch's defaults."""
    defaults = DERIVATIVES[name].defaults
    changed = [f"{k}={v!r}" for k, v in params if v != defaults[k]]
    return f"{name}({', '.join(changed)})" if changed else name
