"""Attention that keeps the model's own kernel and stores only compressed q, k, v.

``F.scaled_dot_product_attention`` (any backend: the CPU flash kernel, the CUDA flash,
memory-efficient and cuDNN kernels, the math path) keeps q, k, v, its output and a
``logsumexp`` for backward. Fused backward kernels recompute the probabilities as
``exp(q k^T * scale - logsumexp)``: with quantized q and k that is no longer normalised and
the gradient blows up. :class:`AttentionFunction` instead runs the very same call in
forward (bitwise the same output), keeps q, k, v compressed at the level's bits (the mask
as it is, the RNG state of dropout exactly), and in backward runs the same call again on the
restored q, k, v and differentiates it: the gradient is the exact gradient of attention at
the restored inputs, memory stays linear in the sequence length, and the output itself is
not kept (the next layer keeps its own copy of it). The cost is one attention forward more
in backward, as with checkpointing the attention alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .compressors import IDENTITY, ChannelScaled, Compressor
from .compressors.channel_scaled import joint_top
from .forward_state import forward_state, plain_saves, replayed
from .stash import OTHER, choose, stash, unstash

__all__ = ["AttentionFunction", "attention"]


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
    )


def _sdpa_as_with_grad(q, k, v, mask, *args) -> torch.Tensor:
    """:func:`_sdpa` picking the kernel it picks when grad is enabled: with a mask that
    requires grad (T5's learned position bias) torch runs another kernel than without, and
    the forward must be the plain model's bitwise. The graph it builds is dropped at once."""
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, mask)]
    hooks = torch.autograd.graph.saved_tensors_hooks(_drop, _never)  # nothing is kept
    with torch.enable_grad(), hooks:
        return _sdpa(*leaves, *args).detach()


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("actcore: the graph of a forward-only attention call is never run")


def _same_exact_dims(
    q: torch.Tensor, k: torch.Tensor, q_: Compressor, k_: Compressor
) -> tuple[Compressor, Compressor]:
    """q's and k's compressors keeping the same feature dims exact, those of largest
    ``amax(q) * amax(k)``: an outlier dim of q multiplies k's rounding error in that dim
    into every logit, and the softmax turns that noise into a bias."""
    if not (isinstance(q_, ChannelScaled) and isinstance(k_, ChannelScaled)):
        return q_, k_
    if not (q_.exact and q_.exact == k_.exact and q.shape[-1] == k.shape[-1]):
        return q_, k_
    top = joint_top(q, k, -1, q_.exact)
    return replace(q_, top=top), replace(k_, top=top)


class AttentionFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` keeping compressed q, k, v (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, layer):
        ctx.state = forward_state(q.device, rng=dropout_p > 0)  # rerun in backward under it
        if isinstance(mask, torch.Tensor) and mask.requires_grad:
            out = _sdpa_as_with_grad(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        else:
            out = _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        ctx.args = (dropout_p, is_causal, scale, enable_gqa)
        mask_tensor = mask if isinstance(mask, torch.Tensor) else None
        ctx.mask_value = None if mask_tensor is not None else mask
        # (each head's features are the channels an outlier sits in)
        q_, k_, v_ = (choose(layer, OTHER, t, channel_dim=-1) for t in (q, k, v))
        q_, k_ = _same_exact_dims(q, k, q_, k_)
        stash(ctx, layer, [(q, q_), (k, k_), (v, v_), (mask_tensor, IDENTITY)])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, mask = unstash(ctx)
        if mask is None:
            mask = ctx.mask_value
        needs = ctx.needs_input_grad[:4]
        leaves = []
        for t, need in zip((q, k, v, mask), needs, strict=True):
            leaves.append(t.detach().requires_grad_(True) if need and t is not None else t)
        wanted = [t for t, need in zip(leaves, needs, strict=True) if need and t is not None]
        with torch.enable_grad(), plain_saves(), replayed(ctx.state):
            out = _sdpa(*leaves, *ctx.args)
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        grads = [
            next(found) if need and t is not None else None
            for t, need in zip(leaves, needs, strict=True)
        ]
        if grads[3] is not None and mask is not None and grads[3].shape != mask.shape:
            grads[3] = grads[3].sum_to_size(mask.shape)
        return (*grads, None, None, None, None, None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layer: Any,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with compressed saved inputs, for ``layer``'s level."""
    return AttentionFunction.apply(
        q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), layer
    )
