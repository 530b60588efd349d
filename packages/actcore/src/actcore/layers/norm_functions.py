"""Autograd functions of the normalization Q-layers.

Batch, synchronised batch, layer, group and RMS normalization, and ``F.normalize``. A lossy
level keeps the *normalized* input (with exact statistics to rebuild the input in
backward); layer, group and RMS norm then also derive their output from that packing, so a
next layer that saves the output stores nothing of its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..compressors import Compressor
from .double_backward import LOST_INPUT, layer_name, refuse_double_backward
from .input_meta import InputMeta
from .roles import NORM, ROW_NORM
from .stash import IDENTITY, choose, derive_output, observe, stash, unstash

__all__ = [
    "BatchNormFunction",
    "GroupNormFunction",
    "LayerNormFunction",
    "NormalizeFunction",
    "RMSNormFunction",
    "SyncBatchNormFunction",
]

aten = torch.ops.aten


def _stat_view(stat: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """A per-channel (``dim=1``) statistic shaped to broadcast against ``x``."""
    return stat.view([-1 if d == dim else 1 for d in range(x.dim())])


def _affine_output(dtype: torch.dtype, per_channel: bool = False):
    """``x_hat * weight + bias`` in ``dtype``: a normalization's output rebuilt from its
    normalized input (``per_channel``: weight and bias scale dim 1, as in group norm; else
    they span the trailing dims, as in layer and RMS norm). Not under torch.compile, where
    the graph's own saved set is what autograd keeps: there a reference to the norm's
    packing would keep it alive next to the copy the graph saves (measured: +60%)."""

    def affine(x_hat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
        shape = (-1,) + (1,) * (x_hat.dim() - 2) if per_channel else None
        y = x_hat.float()
        if weight is not None:
            y = y * (weight.float().view(shape) if shape else weight.float())
        if bias is not None:
            y = y + (bias.float().view(shape) if shape else bias.float())
        return y.to(dtype)

    return affine


def _copied_from(x: torch.Tensor, saved: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(x,)`` where what is saved is a tensor computed from ``x`` (its normalized copy), so
    an in-place change of ``x`` raises at backward as for ``x`` itself (see ``stash``)."""
    return (x,) if saved is not None and saved is not x else ()


def _norm_input(
    layer: Any, x: torch.Tensor, normalize, role: str = NORM
) -> tuple[torch.Tensor, Compressor | str, bool]:
    """What a normalization layer saves for ``x``: ``(tensor, how, normalized)``.

    A lossy compressor gets the *normalized* input ``(x - mean) * invstd`` instead of ``x``:
    its quantization error is then relative to each channel's (row's, group's) own spread,
    not to the range across channels, which can be orders of magnitude larger (a channel
    with a tiny variance would otherwise see its gradient blown up by ``invstd``). Backward
    rebuilds ``x`` from it with the exact saved statistics.
    """
    comp = choose(layer, role, x)
    if not comp.lossy:
        return x, comp, False
    return normalize(x), comp, True


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape, dtype and device filled with ``value``, made once and
    shared (only ever read: the statistics handed to batch norm's kernels as ones and
    zeros), instead of a new one per layer and step."""
    key = (value, tuple(like.shape), like.dtype, like.device)
    found = _CONSTANTS.get(key)
    if found is None:
        with torch.inference_mode(False):  # usable under grad mode, wherever first made
            found = _CONSTANTS[key] = torch.full_like(like, value, requires_grad=False)
    return found


def _normalized(x: torch.Tensor, centre: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x - centre) * scale`` per channel, in ``x``'s dtype, by batch norm's own eval-mode
    kernel: one tensor of ``x``'s size, where the broadcast arithmetic would make float32
    temporaries of a half-precision ``x`` (and keep the float32 result: twice the bytes to
    pack, and a backward that would rebuild ``x`` through two more)."""
    ones = _constant(1.0, scale)
    return aten.native_batch_norm(x, scale, None, centre, ones, False, 0.0, 0.0)[0]


class BatchNormFunction(torch.autograd.Function):
    """Batch normalization (aten.native_batch_norm and its backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, layer):
        out, mean, invstd = aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        ctx.training, ctx.eps, ctx.input_meta = training, eps, InputMeta(x)
        keep_x = training or (weight is not None and weight.requires_grad)
        saved_x, how, ctx.normalized = None, IDENTITY, False
        if keep_x:
            if training:
                centre, scale = mean, invstd
            else:  # eval statistics: what the backward op uses in that case
                centre, scale = running_mean, (running_var + eps).rsqrt()
            saved_x, how, ctx.normalized = _norm_input(
                layer, x, lambda t: _normalized(t, centre, scale)
            )
            ctx.stats = (centre, scale) if ctx.normalized else None
        stash(
            ctx,
            layer,
            [
                (saved_x, how),
                (weight, IDENTITY),
                (running_mean, IDENTITY),
                (running_var, IDENTITY),
                (mean, IDENTITY),
                (invstd, IDENTITY),
            ],
            watch=_copied_from(x, saved_x),
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, running_mean, running_var, mean, invstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        mask = list(ctx.needs_input_grad[:3])
        if ctx.normalized:
            refuse_double_backward(ctx, layer_name(ctx.act_layer))
            centre, scale = ctx.stats
            if ctx.training and x.dtype == grad.dtype:
                # The batch-statistics backward reads x only as x_hat = (x - mean) * invstd:
                # hand it x_hat itself with mean 0 and invstd 1, and the weight times invstd
                # (gx = weight * invstd * (...)): the gradients of x rebuilt from x_hat, without
                # rebuilding it (gw and gb do not depend on the weight handed over).
                w = scale if weight is None else weight * scale
                zeros, ones = _constant(0.0, centre), _constant(1.0, scale)
                gx, gw, gb = aten.native_batch_norm_backward(
                    grad, x, w, None, None, zeros, ones, True, ctx.eps, mask
                )
                return gx, gw, gb, None, None, None, None, None, None
            x = (x / _stat_view(scale, x, 1) + _stat_view(centre, x, 1)).to(ctx.input_meta.dtype)
        gx, gw, gb = aten.native_batch_norm_backward(
            grad,
            x if x is not None else ctx.input_meta.tensor(),
            weight,
            running_mean,
            running_var,
            mean,
            invstd,
            ctx.training,
            ctx.eps,
            mask,
        )
        return gx, gw, gb, None, None, None, None, None, None


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics over all ranks of a process group (training).

    Forward gathers each rank's per-channel (mean, sum of squared deviations, count) and
    combines them exactly; backward all-reduces the per-channel sums of ``grad`` and
    ``grad * x_hat``. Parameter gradients stay local (DDP averages them).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, sync, layer):
        import torch.distributed as dist

        group, world = sync
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        local_mean = xf.mean(dims)
        local_m2 = (xf - _stat_view(local_mean, xf, 1)).square().sum(dims)
        count = torch.full((1,), x.numel() // c, dtype=torch.float32, device=x.device)
        stats = torch.cat([local_mean, local_m2, count])
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats, group=group)
        table = torch.stack(gathered)
        means, m2s, counts = table[:, :c], table[:, c : 2 * c], table[:, 2 * c :]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        var = m2 / total
        invstd = (var + eps).rsqrt()
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = m2 / (total - 1).clamp_min(1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        # the normalisation itself: batch norm in eval form with the global statistics
        out = aten.native_batch_norm(x, weight, bias, mean, var, False, 0.0, eps)[0]
        ctx.sync, ctx.total, ctx.dtype = sync, total, x.dtype
        saved_x, how, ctx.normalized = _norm_input(
            layer, x, lambda t: (t - _stat_view(mean, t, 1)) * _stat_view(invstd, t, 1)
        )
        stash(
            ctx,
            layer,
            [(saved_x, how), (weight, IDENTITY), (mean, IDENTITY), (invstd, IDENTITY)],
            watch=_copied_from(x, saved_x),
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        x, weight, mean, invstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        # its statistics come from collectives outside autograd's view: no second derivative
        refuse_double_backward(ctx, layer_name(ctx.act_layer))
        if ctx.normalized:
            x_hat = x.float()
        else:
            x_hat = (x.float() - _stat_view(mean, x, 1)) * _stat_view(invstd, x, 1)
        g = grad.float()
        dims = [0, *range(2, g.dim())]
        sum_g = g.sum(dims)
        sum_gx = (g * x_hat).sum(dims)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gw = sum_gx.to(weight.dtype) if need_w else None
        gb = sum_g.to(weight.dtype) if need_b else None
        gx = None
        if need_x:
            group, _ = ctx.sync
            sums = torch.cat([sum_g, sum_gx])
            dist.all_reduce(sums, group=group)
            c = sum_g.numel()
            mean_g = _stat_view(sums[:c] / ctx.total, g, 1)
            mean_gx = _stat_view(sums[c:] / ctx.total, g, 1)
            scale = _stat_view(invstd if weight is None else invstd * weight.float(), g, 1)
            gx = ((g - mean_g - x_hat * mean_gx) * scale).to(ctx.dtype)
        return gx, gw, gb, None, None, None, None, None, None


def _stash_affine_norm(
    ctx: Any,
    layer: Any,
    x: torch.Tensor,
    saved_x: torch.Tensor,
    how: Compressor | str,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> list:
    """What layer and group norm keep: the input (as :func:`_norm_input` chose), the affine
    parameters and the per-row statistics, exact."""
    items = [(saved_x, how), (weight, IDENTITY), (bias, IDENTITY), (mean, IDENTITY)]
    return stash(ctx, layer, [*items, (rstd, IDENTITY)], watch=_copied_from(x, saved_x))


class LayerNormFunction(torch.autograd.Function):
    """Layer normalization (aten.native_layer_norm and its backward)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, layer):
        out, mean, rstd = aten.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape, ctx.dtype = normalized_shape, x.dtype
        saved_x, how, ctx.normalized = _norm_input(layer, x, lambda t: (t - mean) * rstd, ROW_NORM)
        parts = _stash_affine_norm(ctx, layer, x, saved_x, how, weight, bias, mean, rstd)
        if ctx.normalized and not torch.compiler.is_compiling():  # (see _affine_output)
            derive_output(ctx, _affine_output(out.dtype), parts[:3], affine=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        if ctx.normalized:
            refuse_double_backward(ctx, layer_name(ctx.act_layer))
            x = (x / rstd + mean).to(ctx.dtype)
        need_x, need_w, need_b = (ctx.needs_input_grad[i] for i in (0, 2, 3))
        gx, gw, gb = aten.native_layer_norm_backward(
            grad, x, ctx.normalized_shape, mean, rstd, weight, bias, [need_x, need_w, need_b]
        )
        return gx, None, gw, gb, None, None


class GroupNormFunction(torch.autograd.Function):
    """Group normalization (aten.native_group_norm and its backward)."""

    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, layer):
        n, c = x.shape[0], x.shape[1]
        hw = math.prod(x.shape[2:])
        out, mean, rstd = aten.native_group_norm(x, weight, bias, n, c, hw, num_groups, eps)
        ctx.sizes, ctx.shape, ctx.dtype = (n, c, hw, num_groups), x.shape, x.dtype

        def normalize(t: torch.Tensor) -> torch.Tensor:
            grouped = t.reshape(n, num_groups, -1)
            return ((grouped - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).view(t.shape)

        saved_x, how, ctx.normalized = _norm_input(layer, x, normalize, ROW_NORM)
        parts = _stash_affine_norm(ctx, layer, x, saved_x, how, weight, bias, mean, rstd)
        if ctx.normalized and out.is_contiguous() and not torch.compiler.is_compiling():
            derive_output(ctx, _affine_output(out.dtype, per_channel=True), parts[:3], affine=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, _, mean, rstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        refuse_double_backward(
            ctx,
            layer_name(ctx.act_layer),
            LOST_INPUT if ctx.normalized else "aten's group-norm backward has no derivative",
        )
        if ctx.normalized:
            n, _, _, groups = ctx.sizes
            grouped = x.reshape(n, groups, -1) / rstd.unsqueeze(-1) + mean.unsqueeze(-1)
            x = grouped.view(ctx.shape).to(ctx.dtype)
        mask = [ctx.needs_input_grad[i] for i in (0, 2, 3)]
        gx, gw, gb = aten.native_group_norm_backward(grad, x, mean, rstd, weight, *ctx.sizes, mask)
        return gx, None, gw, gb, None, None


class NormalizeFunction(torch.autograd.Function):
    """``F.normalize`` (p=2) keeping its output compressed and the norm exact.

    Backward: ``dx = (g - y * sum(g * y)) / max(|x|, eps)`` (the projection left out where
    the norm was clamped to ``eps``). Nothing of ``x`` is kept: the output ``y`` is what the
    next op (a cosine-attention product) saves anyway, so the two share one packing.
    """

    @staticmethod
    def forward(ctx, x, dim, eps, layer, role):
        norm = x.norm(2, dim, keepdim=True)
        denom = norm.clamp_min(eps)
        out = x / denom.expand_as(x)  # F.normalize's own ops: the same output
        ctx.dim = dim
        clamped = norm < eps
        stash(ctx, layer, [(out, role), (denom, IDENTITY), (clamped, IDENTITY)])
        return out

    @staticmethod
    def backward(ctx, grad):
        y, denom, clamped = unstash(ctx)
        refuse_double_backward(ctx, f"F.normalize in {layer_name(ctx.act_layer)}")
        dot = (grad * y).sum(ctx.dim, keepdim=True).masked_fill(clamped, 0)
        return (grad - y * dot) / denom, None, None, None, None


class RMSNormFunction(torch.autograd.Function):
    """RMS normalization (``F.rms_norm``) keeping ``x * rstd`` compressed and ``rstd`` exact.

    ``rstd = 1 / sqrt(mean(x^2) + eps)`` per normalized row, in float32 (the precision
    torch's kernel computes it in for half inputs too). Backward is the analytic one:
    ``dx = rstd * (g w - x_hat * mean(g w * x_hat))``, ``dw = sum(g * x_hat)``.
    """

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, layer):
        out = torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        eps_value = torch.finfo(x.dtype).eps if eps is None else eps
        xf = x.float()
        rstd = xf.square().mean(dims, keepdim=True).add_(eps_value).rsqrt_()
        ctx.dims, ctx.dtype, ctx.eps = dims, x.dtype, eps_value
        saved_x, how, ctx.normalized = _norm_input(layer, x, lambda t: t.float() * rstd, ROW_NORM)
        parts = stash(
            ctx,
            layer,
            [(saved_x, how), (weight, IDENTITY), (rstd, IDENTITY)],
            watch=_copied_from(x, saved_x),
        )
        if ctx.normalized and not torch.compiler.is_compiling():  # (see _affine_output)
            derive_output(ctx, _affine_output(out.dtype), [*parts[:2], None], affine=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        if ctx.normalized:
            refuse_double_backward(ctx, layer_name(ctx.act_layer))
        elif torch.is_grad_enabled():  # exact x: rstd as a function of it, for a 2nd derivative
            rstd = x.float().square().mean(ctx.dims, keepdim=True).add(ctx.eps).rsqrt()
        x_hat = x.float() if ctx.normalized else x.float() * rstd
        g = grad.float()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        gw = gx = None
        if need_w:
            lead = tuple(range(g.dim() - weight.dim()))
            gw = (g * x_hat).sum(lead).to(weight.dtype) if lead else (g * x_hat).to(weight.dtype)
        if need_x:
            gh = g * weight.float() if weight is not None else g
            gx = rstd * (gh - x_hat * (gh * x_hat).mean(ctx.dims, keepdim=True))
            gx = gx.to(ctx.dtype)
        return gx, None, gw, None, None
