"""Autograd functions of the converted convs.

Each forward computes exactly what the stock PyG conv computes (it calls the conv's own
``propagate`` with autograd off) and keeps for backward only what the gradient needs:

* :class:`LinearFunction`: the node features fed to a linear transform, quantized at the
  layer's level, optionally randomly projected first (EXACT's rademacher projection, an
  unbiased weight gradient);
* :class:`LinearAggregation`: a sum or mean aggregation, linear in the node features, so its
  backward needs only the (narrow, shared) edge index and the edge weights, never the
  ``E x C`` gathered messages;
* :class:`GATAttention`: GAT's attention and aggregation; keeps the quantized node features
  (``N x H x C``, from which backward re-gathers the messages), the quantized attention
  coefficients (``E x H``), the leaky-ReLU sign and dropout keep masks at 1 bit, and the
  edge index, never the ``E x H x C`` message tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.utils import softmax as pyg_softmax

from actcore import ops
from actcore.extend import (
    CONV,
    IDENTITY,
    Compressor,
    Quantize,
    Swap,
    choose,
    config,
    dropout_backward,
    dropout_with_mask,
    guard_input,
    layer_spec,
    observe,
    stash,
    unstash,
)

from .graph import Graph

# --------------------------------------------------------------------------------------------
# Compressor choice
# --------------------------------------------------------------------------------------------


def compressor_for(layer: Any, x: Tensor, role: str = CONV) -> Compressor:
    """The compressor for node features ``x`` that ``layer`` keeps in ``role``.

    actcore's choice for the layer's level: groups lie within a node's row (per sample),
    so every node gets its own range; flat groups spanning several nodes cost GAT about
    3 points of accuracy at 2 bits in our runs.
    """
    return choose(layer, role, x)


DEFAULT_ATTENTION_BITS = 8


def attention_compressor(layer: Any, alpha: Tensor) -> Compressor:
    """The compressor for GAT's attention coefficients (``E x H``, flat groups).

    8 bits unless the layer says otherwise (``act_attention_bits``), at every level that
    compresses: the coefficients are a small share of what GAT keeps, and at 2 bits their
    noise (with attention dropout 0.5) cost 9 points of accuracy on the benchmark graph.
    """
    spec = layer_spec(layer)
    bits = getattr(layer, "act_attention_bits", None)
    if bits is None and spec.conv_bits is not None:
        bits = DEFAULT_ATTENTION_BITS
    if bits is None or alpha.numel() < config.min_numel:
        base: Compressor = IDENTITY
    else:
        base = Quantize(bits, config.group_size, per_sample=False, stochastic=config.stochastic)
    return Swap(base) if spec.swap else base


# --------------------------------------------------------------------------------------------
# Linear transform with a compressed (optionally randomly projected) input
# --------------------------------------------------------------------------------------------


def rademacher(rows: int, cols: int, seed: int, dtype: torch.dtype, device: torch.device):
    """A ``rows x cols`` matrix of +-1/sqrt(cols) from ``seed`` (so ``E[R R^T] = I``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    signs = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int8)
    r = signs.to(device=device, dtype=dtype).mul_(2).sub_(1)
    return r.div_(math.sqrt(cols))


def projected_width(in_features: int, fraction: float | None) -> int | None:
    """Kept columns for a random projection keeping ``fraction`` of ``in_features``."""
    if fraction is None:
        return None
    return max(1, min(in_features, round(fraction * in_features)))


class LinearFunction(torch.autograd.Function):
    """``F.linear`` that keeps its input compressed (and randomly projected if asked)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, fraction):
        out = F.linear(x, weight, bias)
        keep = x if weight.requires_grad else None
        ctx.projection = None
        width = projected_width(x.shape[-1], fraction)
        if keep is not None and width is not None and width < x.shape[-1]:
            seed = ops.new_seed() % (2**62)
            r = rademacher(x.shape[-1], width, seed, x.dtype, x.device)
            keep = x.matmul(r)
            ctx.projection = (seed, width)
        comp = IDENTITY if keep is None else compressor_for(layer, keep)
        stash(ctx, layer, [(keep, comp), (weight, IDENTITY)])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = unstash(ctx)
        if ctx.projection is None:  # the adaptive scheme's statistics (of the input it kept)
            observe(ctx, grad, channel_dim=-1, restored=x)
        lossy = x is not None and (ctx.projection is not None or ctx.act_plan[0][1].lossy)
        x = guard_input(ctx, x, weight, grad, lossy)  # a 2nd derivative: a clear error
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = grad.matmul(weight) if need_x else None
        gw = None
        if need_w:
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
            if ctx.projection is not None:
                seed, width = ctx.projection
                r = rademacher(weight.shape[1], width, seed, gw.dtype, gw.device)
                gw = gw.mm(r.t())
        gb = g2.sum(0) if need_b else None
        return gx, gw, gb, None, None


def linear(layer: Any, lin: Any, x: Tensor) -> Tensor:
    """``lin(x)`` (a PyG or torch Linear) with its input kept compressed per ``layer``.

    Without a random projection, ``lin`` keeps the input when it is a Q-layer under an
    adaptive scheme (at L3): the scheme plans bits per linear layer, by the name it knows.
    """
    fraction = getattr(layer, "act_projection", None)
    owner = lin if fraction is None and getattr(lin, "act_scheme", None) is not None else layer
    return LinearFunction.apply(x, lin.weight, lin.bias, owner, fraction)


# --------------------------------------------------------------------------------------------
# Linear aggregations (sum / mean): backward needs the edge index and weights only
# --------------------------------------------------------------------------------------------


def _flow_index(narrow: Tensor, flow: str) -> tuple[Tensor, Tensor]:
    """(source j, target i) rows of an edge index for PyG's ``flow``; int64 on the CPU, whose
    ``index_add_`` takes 2-3x longer with int32 indices (a transient copy, 16 bytes an edge)."""
    if narrow.dtype == torch.int32 and narrow.device.type == "cpu":
        narrow = narrow.long()
    if flow == "source_to_target":
        return narrow[0], narrow[1]
    return narrow[1], narrow[0]


def _shared(graph: Graph) -> tuple[Tensor, ...]:
    """The graph tensors that later layers of this forward look up (see :mod:`.graph`).

    Saved-tensor hooks may keep a detached alias instead of the tensor object itself, so
    the node also references the objects: the cache's weak references stay valid exactly
    as long as this backward can still run. Same storage as what was saved: no extra bytes.
    """
    return (graph.narrow,) if graph.weight is None else (graph.narrow, graph.weight)


class LinearAggregation(torch.autograd.Function):
    """``out[i] = reduce_{e: i_e = i} w_e h[j_e]`` for ``reduce`` in sum / mean.

    ``compute(h)`` is the stock conv's own ``propagate`` (so the output is the stock one);
    backward scatters ``w_e * grad[i_e]`` (divided by the in-degree for a mean) back to
    ``j_e``.
    """

    @staticmethod
    def forward(ctx, h, layer, graph: Graph, mean: bool, flow: str, compute: Callable):
        out = compute(h)
        ctx.mean, ctx.flow, ctx.num_src, ctx.num_dst = mean, flow, h.shape[0], out.shape[0]
        stash(ctx, layer, [(graph.narrow, IDENTITY), (graph.weight, IDENTITY)])
        ctx.act_shared = _shared(graph)
        return out

    @staticmethod
    def backward(ctx, grad):
        narrow, weight = unstash(ctx)
        src, dst = _flow_index(narrow, ctx.flow)
        if ctx.mean:
            count = torch.bincount(dst, minlength=ctx.num_dst).to(grad.dtype).clamp_(min=1)
            grad = grad / count.view(-1, *([1] * (grad.dim() - 1)))
        msg = grad.index_select(0, dst)
        if weight is not None:
            msg = weight.view(-1, *([1] * (grad.dim() - 1))) * msg
        gh = grad.new_zeros((ctx.num_src, *grad.shape[1:])).index_add_(0, src, msg)
        return gh, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# GAT attention + aggregation
# --------------------------------------------------------------------------------------------


class GATAttention(torch.autograd.Function):
    """GATConv's attention and aggregation over ``h = lin(x).view(N, H, C)``.

    Forward: ``a_src = (h * att_src).sum(-1)``, ``e = leaky_relu(a_src[j] + a_dst[i])``,
    ``alpha = softmax_i(e)``, dropout, then the conv's ``propagate`` (``sum alpha h[j]``).
    """

    @staticmethod
    def forward(ctx, h, att_src, att_dst, layer, graph: Graph, compute: Callable):
        src, dst = _flow_index(graph.edge_index, layer.flow)
        n = h.shape[0]
        a_src = (h * att_src).sum(dim=-1)
        a_dst = (h * att_dst).sum(dim=-1)
        e = a_src.index_select(0, src) + a_dst.index_select(0, dst)
        positive = e > 0
        e = F.leaky_relu(e, layer.negative_slope)
        alpha = pyg_softmax(e, dst, None, n)
        p = layer.dropout
        drop_mask = None
        a = alpha
        if layer.training and p > 0:
            if p >= 1:
                a = alpha * 0.0
                drop_mask = torch.zeros_like(alpha, dtype=torch.bool)
            else:
                a, drop_mask = dropout_with_mask(alpha, p)
        out = compute(h, a)
        ctx.flow, ctx.slope, ctx.p = layer.flow, layer.negative_slope, p
        ctx.e_shape = e.shape
        need_params = att_src.requires_grad or att_dst.requires_grad
        keep_h = h if (need_params or h.requires_grad) else None
        stash(
            ctx,
            layer,
            [
                (keep_h, IDENTITY if keep_h is None else compressor_for(layer, keep_h)),
                (alpha, attention_compressor(layer, alpha)),
                (ops.pack_mask(positive), IDENTITY),
                (None if drop_mask is None else ops.pack_mask(drop_mask), IDENTITY),
                (graph.narrow, IDENTITY),
                (att_src, IDENTITY),
                (att_dst, IDENTITY),
            ],
        )
        ctx.act_shared = _shared(graph)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, alpha, positive, drop, narrow, att_src, att_dst = unstash(ctx)
        src, dst = _flow_index(narrow, ctx.flow)
        n = grad.shape[0]
        shape = ctx.e_shape
        a = alpha
        if drop is not None:
            keep = ops.unpack_mask(drop, shape)
            a = dropout_backward(alpha, keep, ctx.p) if ctx.p < 1 else alpha * 0.0
        grad = grad.contiguous()
        # out[i] = sum_e a_e h[j_e]
        g_dst = grad.index_select(0, dst)  # E x H x C, transient
        gh = grad.new_zeros(grad.shape).index_add_(0, src, a.unsqueeze(-1) * g_dst)
        g_a = (g_dst * h.index_select(0, src)).sum(-1)  # E x H
        del g_dst
        if drop is not None:
            g_alpha = dropout_backward(g_a, keep, ctx.p) if ctx.p < 1 else g_a * 0.0
        else:
            g_alpha = g_a
        # softmax over the edges into each node i: g_e = alpha (g_alpha - sum alpha g_alpha)
        dot = grad.new_zeros((n, shape[1])).index_add_(0, dst, alpha * g_alpha)
        g_e = alpha * (g_alpha - dot.index_select(0, dst))
        g_e = torch.where(ops.unpack_mask(positive, shape), g_e, g_e * ctx.slope)
        g_src = grad.new_zeros((n, shape[1])).index_add_(0, src, g_e)
        g_dst_node = grad.new_zeros((n, shape[1])).index_add_(0, dst, g_e)
        gh = gh + g_src.unsqueeze(-1) * att_src + g_dst_node.unsqueeze(-1) * att_dst
        need_h, need_s, need_d = ctx.needs_input_grad[:3]
        g_att_src = (g_src.unsqueeze(-1) * h).sum(0, keepdim=True) if need_s else None
        g_att_dst = (g_dst_node.unsqueeze(-1) * h).sum(0, keepdim=True) if need_d else None
        return (gh if need_h else None), g_att_src, g_att_dst, None, None, None
