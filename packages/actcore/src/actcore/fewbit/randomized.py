"""``RandomizedLinear``: a linear layer whose weight gradient uses a random projection.

With the input flattened to ``X`` (``n x in``, ``n`` = batch x tokens) and the output
gradient to ``G`` (``n x out``), the exact weight gradient is ``G^T X``. Forward keeps only
``S X`` (``k x in``, ``k = ceil(proj_ratio * n)``) for a random ``S`` (``k x n``) with
``E[S^T S] = I``; backward regenerates ``S`` from a stored seed and uses ``(S G)^T (S X)``,
an unbiased estimate of ``G^T X``. ``S`` has i.i.d. entries ``N(0, 1/k)`` (``'gaussian'``)
or ``±1/sqrt(k)`` (``'rademacher'``). The input and bias gradients are exact, the forward
output is ``F.linear``'s. When ``k >= n`` the input itself is kept and the gradient is
exact; when the weight needs no gradient nothing of the input is kept at all.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .. import ops

__all__ = ["DISTRIBUTIONS", "RandomizedLinear", "projection", "randomized_linear"]

DISTRIBUTIONS = ("gaussian", "rademacher")
_BLOCK_ELEMENTS = 1 << 22  # largest block of S generated at once (columns x k)


def _check(proj_ratio: object, distribution: object) -> float:
    if isinstance(proj_ratio, bool) or not isinstance(proj_ratio, (int, float)):
        raise TypeError(f"proj_ratio must be a number in (0, 1], got {proj_ratio!r}")
    if not 0.0 < float(proj_ratio) <= 1.0:
        raise ValueError(f"proj_ratio must be in (0, 1], got {proj_ratio}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return float(proj_ratio)


def _random_block(
    k: int, cols: int, distribution: str, gen: torch.Generator, like: Tensor
) -> Tensor:
    shape, kw = (k, cols), {"generator": gen, "device": like.device, "dtype": like.dtype}
    if distribution == "gaussian":
        block = torch.randn(shape, **kw)
    else:
        block = torch.randint(0, 2, shape, **kw).mul_(2).sub_(1)
    return block.mul_(1.0 / math.sqrt(k))


def projection(mat: Tensor, k: int, seed: int, distribution: str) -> Tensor:
    """``S @ mat`` for the ``k x n`` matrix ``S`` drawn from ``seed`` (``n = mat.shape[0]``).

    ``S`` is generated in column blocks (never all at once for large ``n``), the same way
    for every call with the same arguments, so forward and backward see the same ``S``.
    """
    n = mat.shape[0]
    gen = torch.Generator(device=mat.device)
    gen.manual_seed(seed)
    cols = max(1, _BLOCK_ELEMENTS // k)
    out = None
    for start in range(0, n, cols):
        part = mat[start : start + cols]
        term = _random_block(k, part.shape[0], distribution, gen, mat) @ part
        out = term if out is None else out.add_(term)
    return out if out is not None else mat.new_zeros((k, mat.shape[1]))


class _RandomizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, proj_ratio: float, distribution: str, seed: int | None):
        y = F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1]).to(y.dtype)  # autocast may change the dtype
        n = flat.shape[0]
        k = math.ceil(proj_ratio * n)
        ctx.seed = ops.new_seed() if seed is None else seed
        ctx.k, ctx.distribution, ctx.exact = k, distribution, k >= n
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        kept = None
        if ctx.needs_input_grad[1]:
            kept = flat if ctx.exact else projection(flat, k, ctx.seed, distribution)
        ctx.save_for_backward(weight if ctx.needs_input_grad[0] else None, kept)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        weight, kept = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(g.dtype)).view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            sg = g if ctx.exact else projection(g, ctx.k, ctx.seed, ctx.distribution)
            grad_w = (sg.t() @ kept.to(sg.dtype)).to(ctx.w_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def randomized_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    proj_ratio: float = 0.2,
    distribution: str = "gaussian",
    seed: int | None = None,
) -> Tensor:
    """``F.linear`` whose weight gradient is estimated from a random projection that keeps
    ``ceil(proj_ratio * n)`` of the ``n`` rows of the flattened input (see the module doc).
    ``seed`` fixes ``S`` (default: a fresh :func:`actcore.ops.new_seed` per call)."""
    proj_ratio = _check(proj_ratio, distribution)
    needs = torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs or input.dim() == 0:
        return F.linear(input, weight, bias)
    return _RandomizedLinearFunction.apply(input, weight, bias, proj_ratio, distribution, seed)


class RandomizedLinear(nn.Linear):
    """:class:`torch.nn.Linear` whose weight gradient comes from a random projection of the
    input along the flattened batch/token axis (``proj_ratio`` of its rows are kept)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        proj_ratio: float = 0.2,
        distribution: str = "gaussian",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.proj_ratio = _check(proj_ratio, distribution)
        self.distribution = distribution

    def forward(self, input: Tensor) -> Tensor:
        return randomized_linear(input, self.weight, self.bias, self.proj_ratio, self.distribution)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, proj_ratio={self.proj_ratio}, "
            f"distribution={self.distribution!r}"
        )
