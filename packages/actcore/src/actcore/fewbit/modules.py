"""Few-bit activation modules: drop-in subclasses of the torch modules.

Each takes torch's constructor arguments plus ``bits`` and subclasses the torch class, so
``isinstance`` checks, ``repr`` (plus ``bits``) and ``state_dict`` stay the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..layers.base import ConvertedLayer, run_outside_compile
from ..saved_tensors.op_mode import call_outside_modes
from . import functional as FB
from .functional import DEFAULT_BITS
from .tables import check_bits

__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "SELU",
    "Hardshrink",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "LeakyReLU",
    "LogSigmoid",
    "Mish",
    "ReLU",
    "ReLU6",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Softshrink",
    "Softsign",
    "Tanh",
    "Tanhshrink",
    "Threshold",
]


class FewBitActivation(ConvertedLayer, nn.Module):
    """Mixin: the ``bits`` attribute and its ``repr``.

    Under torch.compile inside a converted model's scope it is traced as the torch module it
    subclasses: the scope's saved-tensor hooks, inlined into the compiled graph, pack what
    that saves (as for the Q-layers). Anywhere else a compiled model runs it eagerly (a
    graph break), with its few-bit derivative."""

    bits: int
    _torch_forward: Any = None  # the torch class's forward (set per subclass)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        torch_classes = [c for c in cls.__mro__ if c.__module__.startswith("torch.nn.")]
        found = [c for c in torch_classes if c is not nn.Module and "forward" in vars(c)]
        cls._torch_forward = found[0].forward if found else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if self.act_in_scope and self._torch_forward is not None:
                return self._torch_forward(*args, **kwargs)
            return run_outside_compile(super().__call__, args, kwargs)  # type: ignore[misc]
        # its own tailored treatment: a converted model's functional-op router stays out
        return call_outside_modes(super().__call__, args, kwargs)  # type: ignore[misc]

    def _set_bits(self, bits: int) -> None:
        self.bits = check_bits(bits)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return f"{base}, bits={self.bits}" if base else f"bits={self.bits}"


# Piecewise-linear (exact gradient from 1 bit; ``bits`` only checked).


class ReLU(FewBitActivation, nn.ReLU):
    def __init__(self, inplace: bool = False, bits: int = 1) -> None:
        nn.ReLU.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.relu(input, self.inplace, self.bits)


class LeakyReLU(FewBitActivation, nn.LeakyReLU):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False, bits: int = 1):
        nn.LeakyReLU.__init__(self, negative_slope, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.leaky_relu(input, self.negative_slope, self.inplace, self.bits)


class Threshold(FewBitActivation, nn.Threshold):
    def __init__(self, threshold: float, value: float, inplace: bool = False, bits: int = 1):
        nn.Threshold.__init__(self, threshold, value, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.threshold(input, self.threshold, self.value, self.inplace, self.bits)


class Hardtanh(FewBitActivation, nn.Hardtanh):
    def __init__(
        self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, bits: int = 1
    ) -> None:
        nn.Hardtanh.__init__(self, min_val, max_val, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.hardtanh(input, self.min_val, self.max_val, self.inplace, self.bits)


class ReLU6(FewBitActivation, nn.ReLU6):
    def __init__(self, inplace: bool = False, bits: int = 1) -> None:
        nn.ReLU6.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.relu6(input, self.inplace, self.bits)


class Hardsigmoid(FewBitActivation, nn.Hardsigmoid):
    def __init__(self, inplace: bool = False, bits: int = 1) -> None:
        nn.Hardsigmoid.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.hardsigmoid(input, self.inplace, self.bits)


class Hardshrink(FewBitActivation, nn.Hardshrink):
    def __init__(self, lambd: float = 0.5, bits: int = 1) -> None:
        nn.Hardshrink.__init__(self, lambd)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.hardshrink(input, self.lambd, self.bits)


class Softshrink(FewBitActivation, nn.Softshrink):
    def __init__(self, lambd: float = 0.5, bits: int = 1) -> None:
        nn.Softshrink.__init__(self, lambd)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.softshrink(input, self.lambd, self.bits)


# Continuous (optimal ``bits``-bit derivative tables).


class CELU(FewBitActivation, nn.CELU):
    def __init__(self, alpha: float = 1.0, inplace: bool = False, bits: int = DEFAULT_BITS):
        nn.CELU.__init__(self, alpha, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.celu(input, self.alpha, self.inplace, self.bits)


class ELU(FewBitActivation, nn.ELU):
    def __init__(self, alpha: float = 1.0, inplace: bool = False, bits: int = DEFAULT_BITS):
        nn.ELU.__init__(self, alpha, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.elu(input, self.alpha, self.inplace, self.bits)


class GELU(FewBitActivation, nn.GELU):
    def __init__(self, approximate: str = "none", bits: int = DEFAULT_BITS) -> None:
        nn.GELU.__init__(self, approximate)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.gelu(input, self.approximate, self.bits)


class Hardswish(FewBitActivation, nn.Hardswish):
    def __init__(self, inplace: bool = False, bits: int = DEFAULT_BITS) -> None:
        nn.Hardswish.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.hardswish(input, self.inplace, self.bits)


class LogSigmoid(FewBitActivation, nn.LogSigmoid):
    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        nn.LogSigmoid.__init__(self)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.logsigmoid(input, self.bits)


class Mish(FewBitActivation, nn.Mish):
    def __init__(self, inplace: bool = False, bits: int = DEFAULT_BITS) -> None:
        nn.Mish.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.mish(input, self.inplace, self.bits)


class SELU(FewBitActivation, nn.SELU):
    def __init__(self, inplace: bool = False, bits: int = DEFAULT_BITS) -> None:
        nn.SELU.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.selu(input, self.inplace, self.bits)


class Sigmoid(FewBitActivation, nn.Sigmoid):
    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        nn.Sigmoid.__init__(self)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.sigmoid(input, self.bits)


class SiLU(FewBitActivation, nn.SiLU):
    def __init__(self, inplace: bool = False, bits: int = DEFAULT_BITS) -> None:
        nn.SiLU.__init__(self, inplace)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.silu(input, self.inplace, self.bits)


class Softplus(FewBitActivation, nn.Softplus):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0, bits: int = DEFAULT_BITS):
        nn.Softplus.__init__(self, beta, threshold)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.softplus(input, self.beta, self.threshold, self.bits)


class Softsign(FewBitActivation, nn.Softsign):
    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        nn.Softsign.__init__(self)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.softsign(input, self.bits)


class Tanh(FewBitActivation, nn.Tanh):
    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        nn.Tanh.__init__(self)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.tanh(input, self.bits)


class Tanhshrink(FewBitActivation, nn.Tanhshrink):
    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        nn.Tanhshrink.__init__(self)
        self._set_bits(bits)

    def forward(self, input: Tensor) -> Tensor:
        return FB.tanhshrink(input, self.bits)
