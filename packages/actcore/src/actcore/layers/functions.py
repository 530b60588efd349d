"""Autograd functions of the Q-layers.

Each forward computes exactly what the torch layer computes (the same aten op), saves
through :func:`actcore.stash.stash` (which compresses per the layer's level), and each
backward calls the public aten backward op of that layer on the restored tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import ops
from ..compressors import Compressor
from ..stash import (
    CONV,
    IDENTITY,
    NORM,
    ROW_NORM,
    choose,
    derive_output,
    layer_spec,
    note_mask,
    note_output,
    observe,
    source_part,
    stash,
    unstash,
)

__all__ = [
    "AvgPoolFunction",
    "BatchNormFunction",
    "ConvFunction",
    "DropoutFunction",
    "GroupNormFunction",
    "LayerNormFunction",
    "LinearFunction",
    "MaskedActivationFunction",
    "MaxPoolFunction",
    "NormalizeFunction",
    "RMSNormFunction",
    "SyncBatchNormFunction",
    "dropout_backward",
    "dropout_with_mask",
    "guard_input",
    "layer_name",
    "link",
    "no_second_derivative",
    "note_dropout_output",
    "note_output_mask",
    "own_output",
    "refuse_double_backward",
]

aten = torch.ops.aten

# --- double backward ---------------------------------------------------------------------
#
# A backward run with ``create_graph=True`` builds a graph of itself for a second derivative
# (gradient penalties). Per op (see the README's "Works with"):
# * exact tensors (masks, max-pool offsets, inputs kept at full precision, weights): the
#   backward is made of differentiable ops on them, so the second derivative is exact;
# * normalization layers, SyncBatchNorm, with a compressed input: their input gradient
#   depends on the input itself, which is gone; a create_graph backward through them raises
#   at once, naming the layer;
# * conv/linear with a compressed input: the input gradient (``grad @ W``) is exact; only the
#   weight gradient uses the restored input, whose own derivative is unavailable: it is
#   wired to raise, naming the layer, if (and only if) a second derivative needs it.


def link(x: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor on ``x``'s autograd graph that holds none of ``x``'s memory.

    Passed to an autograd function beside ``x``, it lets a later double backward reach
    ``x``'s history exactly where the second derivative through the restored ``x`` belongs.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return None
    # no elements: no memory (a clone of an empty view allocates nothing and keeps nothing
    # of x's storage), yet on x's graph
    return (x.narrow(0, 0, 0) if x.dim() else x.reshape(1)[:0]).clone()


class _Unavailable(torch.autograd.Function):
    """Identity on ``t``, attached to ``anchors``; its backward raises ``message``."""

    @staticmethod
    def forward(ctx, t, message, *anchors):
        ctx.message = message
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


def layer_name(layer: Any) -> str:
    name = getattr(layer, "act_name", None)
    kind = type(layer).__name__
    return kind if name is None else f"{kind} {name or '<root>'!r}"


def no_second_derivative(
    t: torch.Tensor, what: str, anchors: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    """``t`` (restored from a lossy packing) such that differentiating through it raises."""
    live = [a for a in anchors if a is not None and a.requires_grad]
    if not live:
        return t
    message = (
        f"double backward (create_graph=True) through {what}: the tensor it saved for backward "
        "is stored compressed, so its second derivative is not available. Keep this layer "
        "exact (convert(..., exclude=[...]) or level L0), or compute the penalty's graph "
        "outside the converted model."
    )
    return _Unavailable.apply(t, message, *live)


_LOST_INPUT = (
    "its input gradient depends on its input, which is stored compressed, so the second "
    "derivative is not available (it would be silently wrong)"
)


def refuse_double_backward(ctx: Any, what: str, why: str = _LOST_INPUT) -> None:
    """Raise now in a create_graph backward of ``what``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"double backward (create_graph=True) through {what}: {why}. Keep this layer "
            "as torch's own (convert(..., exclude=[...])), or compute the penalty's graph "
            "outside the converted model."
        )


def _lossy(ctx: Any, item: int) -> bool:
    """Whether ``stash``'s ``item``-th tensor of ``ctx`` was packed by a lossy compressor."""
    comp = ctx.act_plan[item][1]
    return comp is not None and comp.lossy


class _Meta:
    """``x``'s shape, dtype and device, for backward ops that read only those of an input.

    Holds no tensor (so nothing is counted as kept for backward); ``tensor()`` builds a
    one-element stand-in expanded to the shape when backward needs it.
    """

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, x: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device

    def tensor(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)


def own_output(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor of its own, not a view (same storage, same values).

    A custom autograd function's output that is a view (``F.linear`` of a 3-D input returns
    ``addmm(...).view(...)``) cannot be modified in place afterwards; the layer it replaces
    returns one that can, and models do (``nn.ReLU(inplace=True)`` after a linear).
    """
    if out._base is None:
        return out
    return aten._unsafe_view(out, out.shape)


def _empty_like_shape(x: torch.Tensor) -> _Meta:
    return _Meta(x)


def _micro_batches(layer: Any, x: torch.Tensor) -> int:
    return max(1, min(layer_spec(layer).micro_batches, x.shape[0] if x.dim() else 1))


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


class ConvFunction(torch.autograd.Function):
    """Convolution and transposed convolution (aten.convolution / convolution_backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, args, x_link=None):
        stride, padding, dilation, transposed, output_padding, groups = args
        out = own_output(
            aten.convolution(
                x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
            )
        )
        ctx.layer, ctx.args = layer, args
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.input_meta = _empty_like_shape(x)
        stash(ctx, layer, [(x if weight.requires_grad else None, CONV), (weight, IDENTITY)])
        ctx.x_link = x_link
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = unstash(ctx)
        observe(ctx, grad, kernel=math.prod(weight.shape[2:]))
        x = guard_input(ctx, x, weight, grad)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_for_shape = x if x is not None else ctx.input_meta.tensor()
        chunks = _micro_batches(ctx.layer, x_for_shape) if need_w and x is not None else 1
        if chunks == 1:  # the op itself: no split, no cat or sum of one part
            gx, gw, gb = aten.convolution_backward(
                grad, x_for_shape, weight, ctx.bias_sizes, *ctx.args, [need_x, need_w, need_b]
            )
            return gx, gw, gb, None, None, None
        results = []
        for g_part, x_part in zip(grad.chunk(chunks), x_for_shape.chunk(chunks), strict=True):
            results.append(
                aten.convolution_backward(
                    g_part, x_part, weight, ctx.bias_sizes, *ctx.args, [need_x, need_w, need_b]
                )
            )
        gx = torch.cat([r[0] for r in results]) if need_x else None
        gw = sum(r[1] for r in results) if need_w else None
        gb = sum(r[2] for r in results) if need_b else None
        return gx, gw, gb, None, None, None


class LinearFunction(torch.autograd.Function):
    """``F.linear`` with a compressed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, x_link=None):
        out = own_output(torch.nn.functional.linear(x, weight, bias))
        stash(ctx, layer, [(x if weight.requires_grad else None, CONV), (weight, IDENTITY)])
        ctx.x_link = x_link
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = unstash(ctx)
        observe(ctx, grad, channel_dim=-1, restored=x)
        x = guard_input(ctx, x, weight, grad)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = grad.matmul(weight) if need_x else None
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        gb = g2.sum(0) if need_b else None
        return gx, gw, gb, None, None


def guard_input(
    ctx: Any,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    grad: torch.Tensor,
    lossy: bool | None = None,
) -> torch.Tensor | None:
    """In a create_graph backward, the restored input of a conv/linear whose input required
    grad: differentiating through it raises (its derivative is the lost exact input's).

    ``lossy``: whether ``x`` differs from the input (default: its ``stash`` compressor says).
    """
    if x is None or not torch.is_grad_enabled() or not ctx.needs_input_grad[0]:
        return x
    if not (_lossy(ctx, 0) if lossy is None else lossy):
        return x
    x_link = getattr(ctx, "x_link", None)
    anchors = (x_link,) if x_link is not None else (weight, grad)
    return no_second_derivative(x, layer_name(ctx.act_layer), anchors)


class BatchNormFunction(torch.autograd.Function):
    """Batch normalization (aten.native_batch_norm and its backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, layer):
        out, mean, invstd = aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        ctx.training, ctx.eps, ctx.input_meta = training, eps, _empty_like_shape(x)
        keep_x = training or (weight is not None and weight.requires_grad)
        saved_x, how, ctx.normalized = None, IDENTITY, False
        if keep_x:
            if training:
                centre, scale = mean, invstd
            else:  # eval statistics: what the backward op uses in that case
                centre, scale = running_mean, (running_var + eps).rsqrt()
            saved_x, how, ctx.normalized = _norm_input(
                layer, x, lambda t: (t - _stat_view(centre, t, 1)).mul_(_stat_view(scale, t, 1))
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
                ones = torch.ones_like(scale)
                w = scale if weight is None else weight * scale
                gx, gw, gb = aten.native_batch_norm_backward(
                    grad, x, w, None, None, torch.zeros_like(centre), ones, True, ctx.eps, mask
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
            ctx, layer, [(saved_x, how), (weight, IDENTITY), (mean, IDENTITY), (invstd, IDENTITY)]
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


class LayerNormFunction(torch.autograd.Function):
    """Layer normalization (aten.native_layer_norm and its backward)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, layer):
        out, mean, rstd = aten.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape, ctx.dtype = normalized_shape, x.dtype
        saved_x, how, ctx.normalized = _norm_input(layer, x, lambda t: (t - mean) * rstd, ROW_NORM)
        parts = stash(
            ctx,
            layer,
            [
                (saved_x, how),
                (weight, IDENTITY),
                (bias, IDENTITY),
                (mean, IDENTITY),
                (rstd, IDENTITY),
            ],
        )
        if ctx.normalized and not torch.compiler.is_compiling():  # (see _affine_output)
            derive_output(ctx, _affine_output(out.dtype), parts[:3])
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
        parts = stash(
            ctx,
            layer,
            [
                (saved_x, how),
                (weight, IDENTITY),
                (bias, IDENTITY),
                (mean, IDENTITY),
                (rstd, IDENTITY),
            ],
        )
        if ctx.normalized and out.is_contiguous() and not torch.compiler.is_compiling():
            derive_output(ctx, _affine_output(out.dtype, per_channel=True), parts[:3])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, _, mean, rstd = unstash(ctx)
        observe(ctx, grad, norm=True)
        refuse_double_backward(
            ctx,
            layer_name(ctx.act_layer),
            _LOST_INPUT if ctx.normalized else "aten's group-norm backward has no derivative",
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
        parts = stash(ctx, layer, [(saved_x, how), (weight, IDENTITY), (rstd, IDENTITY)])
        if ctx.normalized and not torch.compiler.is_compiling():  # (see _affine_output)
            derive_output(ctx, _affine_output(out.dtype), [*parts[:2], None])
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


class MaskedActivationFunction(torch.autograd.Function):
    """Activations whose derivative takes two values, kept as a 1-bit mask.

    ``kind`` is one of ``relu``, ``leaky_relu`` (``param`` = slope), ``hardtanh``
    (``param`` = (min, max)); the backward matches torch's own, kink conventions included.
    """

    @staticmethod
    def forward(ctx, x, kind, param, inplace, layer):
        if kind == "relu":
            out = torch.relu_(x) if inplace else torch.relu(x)
            mask = ~(out <= 0)  # as torch's threshold_backward: NaN passes the gradient
        elif kind == "leaky_relu":
            mask = x > 0
            out = torch.nn.functional.leaky_relu(x, param, inplace=inplace)
        else:
            lo, hi = param
            mask = ~((x <= lo) | (x >= hi))
            out = torch.nn.functional.hardtanh(x, lo, hi, inplace=inplace)
        if inplace:
            ctx.mark_dirty(x)
        packed = ops.pack_mask(mask)
        ctx.kind, ctx.param, ctx.shape = kind, param, x.shape
        stash(ctx, layer, [(packed, IDENTITY)])
        ctx.act_mask = packed  # read back by the module: see note_output_mask
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = unstash(ctx)
        if ctx.kind == "leaky_relu":
            mask = ops.unpack_mask(packed, ctx.shape)
            return torch.where(mask, grad, grad * ctx.param), None, None, None, None
        # where(mask, grad, 0) read straight from the bits (contiguous, as grad mostly is)
        if torch.is_grad_enabled():  # a create_graph backward: differentiable ops
            return torch.where(ops.unpack_mask(packed, ctx.shape), grad, 0), None, None, None, None
        return ops.apply_mask(grad, packed), None, None, None, None


def note_dropout_output(out: torch.Tensor) -> torch.Tensor:
    """After ``apply`` of :class:`DropoutFunction`: see :func:`actcore.stash.note_output`."""
    return note_output(out)


def note_output_mask(out: torch.Tensor) -> torch.Tensor:
    """Record that a ReLU output's nonzeros are its 1-bit mask's, for the next layer.

    Called after ``apply`` returns: autograd bumps an in-place output's version once
    more after ``forward``, and the record must match the version the next layer sees.
    """
    node = out.grad_fn
    packed = getattr(node, "act_mask", None)
    if packed is not None:
        note_mask(out, packed)
    return out


def dropout_with_mask(
    x: torch.Tensor, p: float, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.dropout(x, p, training=True, inplace)`` (same random stream, same result) and its
    keep mask (bool)."""
    if x.device.type in ("cuda", "xpu") and x.numel() > 0:
        out, mask = aten.native_dropout(x, p, True)  # what F.dropout runs there
        return (x.copy_(out) if inplace else out), mask
    # F.dropout on CPU: x * (bernoulli(1 - p) / (1 - p))
    noise = torch.empty_like(x).bernoulli_(1 - p)
    mask = noise.bool()
    noise.div_(1 - p)
    return (x.mul_(noise) if inplace else x * noise), mask


def dropout_backward(grad: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The gradient through dropout with keep ``mask`` (also: what it makes of a tensor)."""
    if grad.device.type in ("cuda", "xpu"):
        return aten.native_dropout_backward(grad, mask, 1.0 / (1 - p))
    return grad * mask.to(grad.dtype).div_(1 - p)


class DropoutFunction(torch.autograd.Function):
    """Dropout with its mask at 1 bit; same random stream and output as ``F.dropout``."""

    @staticmethod
    def forward(ctx, x, p, inplace, layer):
        ctx.p, ctx.shape = p, x.shape
        out, mask = dropout_with_mask(x, p, inplace)
        if inplace:
            ctx.mark_dirty(x)
        packed = ops.pack_mask(mask)
        stash(ctx, layer, [(packed, IDENTITY)])
        part = None if inplace else source_part(x)
        if part is not None:  # a later save of out rebuilds it from x's packing and the mask
            shape, scale = x.shape, 1.0 / (1.0 - p)

            def dropped(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                return x * ops.unpack_mask(mask, shape).to(x.dtype) * scale

            derive_output(ctx, dropped, [part, (IDENTITY, (packed,), None)])
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = unstash(ctx)
        mask = ops.unpack_mask(packed, ctx.shape)
        return dropout_backward(grad, mask, ctx.p), None, None, None


class MaxPoolFunction(torch.autograd.Function):
    """Max pooling that keeps each output's argmax as its offset inside the window.

    The offset needs ``ceil(log2(window size))`` bits per output element instead of an
    int64 flat index; backward rebuilds the flat indices for the aten backward op.
    """

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode, layer):
        nd = len(kernel)
        pool = torch.nn.functional.max_pool2d if nd == 2 else torch.nn.functional.max_pool3d
        out, index = pool(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        window = math.prod(kernel)
        bits = max(1, math.ceil(math.log2(window)))
        ctx.geometry = (kernel, stride, padding, dilation, ceil_mode)
        ctx.input_meta = _empty_like_shape(x)
        ctx.out_shape, ctx.bits = out.shape, bits
        offset = _window_offset(index, x.shape[-nd:], *ctx.geometry[:4])
        if bits <= 8:
            saved = ops.pack_bits(offset.to(torch.uint8), bits)
        else:
            saved = offset.to(torch.int16 if window <= 2**15 else torch.int32)
        stash(ctx, layer, [(saved, IDENTITY)])
        return out

    @staticmethod
    def backward(ctx, grad):
        (saved,) = unstash(ctx)
        if ctx.bits <= 8:
            offset = ops.unpack_bits(saved, ctx.bits, math.prod(ctx.out_shape))
            offset = offset.view(ctx.out_shape).long()
        else:
            offset = saved.long()
        kernel, stride, padding, dilation, ceil_mode = ctx.geometry
        nd = len(kernel)
        x_meta = ctx.input_meta.tensor()
        index = _flat_index(offset, x_meta.shape[-nd:], kernel, stride, padding, dilation)
        backward = (
            aten.max_pool2d_with_indices_backward
            if nd == 2
            else aten.max_pool3d_with_indices_backward
        )
        gx = backward(grad, x_meta, kernel, stride, padding, dilation, ceil_mode, index)
        return gx, None, None, None, None, None, None


def _window_starts(out_shape, stride, padding, device) -> list[torch.Tensor]:
    """Per spatial dim, the (broadcastable) input coordinate where each window starts."""
    nd = len(stride)
    starts = []
    for d in range(nd):
        size = out_shape[-nd + d]
        view = [1] * nd
        view[d] = size
        pos = torch.arange(size, device=device) * stride[d] - padding[d]
        starts.append(pos.view(view))
    return starts


def _window_offset(index, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
    """Flat input index (per plane) -> offset inside the pooling window."""
    nd = len(kernel)
    starts = _window_starts(index.shape, stride, padding, index.device)
    offset = torch.zeros_like(index)
    rest = index
    coords = []
    for d in reversed(range(nd)):  # peel coordinates, last dim first
        coords.append(rest % in_spatial[d])
        rest = rest // in_spatial[d]
    coords.reverse()
    for d in range(nd):
        offset = offset * kernel[d] + (coords[d] - starts[d]) // dilation[d]
    return offset


def _flat_index(offset, in_spatial, kernel, stride, padding, dilation) -> torch.Tensor:
    """Offset inside the pooling window -> flat input index (per plane)."""
    nd = len(kernel)
    starts = _window_starts(offset.shape, stride, padding, offset.device)
    index = torch.zeros_like(offset)
    rest = offset
    within = []
    for d in reversed(range(nd)):
        within.append(rest % kernel[d])
        rest = rest // kernel[d]
    within.reverse()
    for d in range(nd):
        index = index * in_spatial[d] + starts[d] + within[d] * dilation[d]
    return index


class AvgPoolFunction(torch.autograd.Function):
    """Average pooling that saves nothing: its backward needs only the input's shape."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor, layer):
        nd = len(kernel)
        if nd == 2:
            out = aten.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        else:
            out = aten.avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.input_meta = _empty_like_shape(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        backward = aten.avg_pool2d_backward if len(ctx.args[0]) == 2 else aten.avg_pool3d_backward
        gx = backward(grad, ctx.input_meta.tensor(), *ctx.args)
        return gx, None, None, None, None, None, None, None
