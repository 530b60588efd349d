"""The one autograd function behind every few-bit activation.

Forward runs torch's own functional (so the output is bitwise torch's) and stores, per
element, a ``bits``-bit code of which piece of the derivative applies, packed with
:func:`actcore.ops.pack_bits` (``ceil(n / 8) * bits`` bytes). Backward unpacks the codes and
multiplies the incoming gradient by ``levels[code]``. What differs between activations is
only the *code*: a :class:`TableCode` (interval of ``x``, or of ``|x|``, in an optimal
table) or a :class:`MaskCode` (a torch-exact comparison, for piecewise-linear activations
whose derivative takes two values).

NaN. A table has no code to spare for NaN, so a tensor with a NaN anywhere in its input gets
a NaN gradient everywhere (a flag kept beside the codes: a 0-d tensor on a GPU, no device
sync; a Python bool on the CPU; the derivative of a smooth
activation at NaN is NaN, and it is never hidden). Mask codes follow torch's own backward,
NaN included (e.g. ``hardsigmoid``'s is 0 there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from .. import ops
from ..layers.double_backward import link, no_second_derivative
from .tables import Table

__all__ = ["Code", "MaskCode", "TableCode", "apply"]

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of comparisons and products: float32 for half types (as torch's opmath)."""
    return torch.float32 if dtype in _HALF else dtype


class Code(Protocol):
    """Maps inputs to ``bits``-bit codes, and codes to derivative values."""

    bits: int

    def encode(self, x: Tensor) -> Tensor:
        """uint8 codes below ``2**bits``, one per element of ``x``."""
        ...

    def levels(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The derivative value of each code, as a 1-D tensor of ``dtype``."""
        ...


class _LevelCache:
    """Per-(dtype, device) tensors of a fixed list of values (no transfer per call)."""

    def __init__(self, values: tuple[float, ...]) -> None:
        self.values = values
        self._cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def get(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (dtype, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.tensor(self.values, dtype=dtype, device=device)
        return t


class TableCode:
    """Code = index of the table interval holding ``x`` (``|x|`` for a folded table).

    The comparison runs in float32 for half inputs (exact: every half value is a float32),
    in the input dtype otherwise.
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self.bits = table.bits
        self._borders = _LevelCache(table.borders)
        self._levels = _LevelCache(table.levels)

    def encode(self, x: Tensor) -> Tensor:
        xc = x.to(_compute_dtype(x.dtype)).contiguous()
        if self.table.folded:
            xc = xc.abs()
        borders = self._borders.get(xc.dtype, x.device)
        return torch.bucketize(xc, borders, out_int32=True).to(torch.uint8)

    def levels(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self._levels.get(dtype, device)

    def __repr__(self) -> str:
        return f"TableCode({self.table.key!r}, bits={self.bits})"


class MaskCode:
    """1-bit code from a comparison: ``levels[1]`` where ``predicate(x)`` holds, else
    ``levels[0]``. Exact when the predicate is torch's backward branch condition, evaluated
    in the same dtype (``upcast_half``: float32 for half inputs)."""

    bits = 1

    def __init__(
        self,
        predicate: Callable[[Tensor], Tensor],
        levels: tuple[float, float],
        *,
        upcast_half: bool = False,
    ) -> None:
        self.predicate = predicate
        self.upcast_half = upcast_half
        self._levels = _LevelCache(levels)

    def encode(self, x: Tensor) -> Tensor:
        if self.upcast_half:
            x = x.to(_compute_dtype(x.dtype))
        return self.predicate(x).view(torch.uint8)

    def levels(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self._levels.get(dtype, device)

    def __repr__(self) -> str:
        return f"MaskCode(levels={self._levels.values})"


class _FewBitFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        forward: Callable[[Tensor], Tensor],
        code: Code,
        inplace: bool,
        x_link: Tensor | None = None,
    ):
        packed = ops.pack_bits(code.encode(x), code.bits)  # before an in-place forward
        # a table has no code for NaN: a 0-d flag (no host sync) makes the gradient NaN
        nan: Tensor | bool | None = x.isnan().any() if isinstance(code, TableCode) else None
        if nan is not None and x.device.type == "cpu":
            nan = bool(nan)  # no device to sync with: a Python bool holds no memory
        y = forward(x)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(packed)
        ctx.nan = nan
        ctx.code = code
        ctx.shape = x.shape
        ctx.x_link = x_link
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():  # create_graph: d/dgrad exact, d/dx unavailable
            with torch.no_grad():
                slope = _FewBitFunction._slope(ctx, grad)
            if isinstance(ctx.code, TableCode):  # a mask's derivative has derivative 0
                slope = no_second_derivative(
                    slope, f"the few-bit activation derivative {ctx.code!r}", (ctx.x_link,)
                )
            return grad * slope.to(grad.dtype), None, None, None, None
        return (
            grad.to(_compute_dtype(grad.dtype))
            .mul(_FewBitFunction._slope(ctx, grad))
            .to(grad.dtype),
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def _slope(ctx, grad: Tensor) -> Tensor:
        (packed,) = ctx.saved_tensors
        nan = ctx.nan
        shape: torch.Size = ctx.shape
        index = ops.unpack_bits(packed, ctx.code.bits, shape.numel()).to(torch.int32)
        dtype = _compute_dtype(grad.dtype)
        slope = ctx.code.levels(dtype, grad.device).index_select(0, index).view(shape)
        if isinstance(nan, Tensor):  # NaN in, NaN out: f'(NaN) is NaN
            slope = torch.where(nan, torch.nan, slope)
        elif nan:
            slope = torch.full_like(slope, torch.nan)
        return slope


def apply(
    x: Tensor,
    forward: Callable[[Tensor], Tensor],
    code: Code | Callable[[], Code],
    *,
    inplace: bool = False,
) -> Tensor:
    """``forward(x)`` with the derivative replaced by ``code``'s levels.

    ``forward`` must compute the activation (in place on ``x`` and return it when
    ``inplace``). ``code`` may be a zero-argument factory, called only when a gradient is
    needed: with grad disabled or ``x`` not requiring grad this is just ``forward(x)``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"few-bit activations take a torch.Tensor, got {type(x).__name__}")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return forward(x)
    if not hasattr(code, "encode"):
        code = code()
    return _FewBitFunction.apply(x, forward, code, inplace, link(x))
