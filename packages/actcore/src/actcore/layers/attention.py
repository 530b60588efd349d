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

Both routes use it: the layer route stashes q, k, v at its layer's level; the saved-tensor
hooks route (``layer=None``, through :class:`actcore.layers.routing.AttentionRouter`)
saves them with ``ctx.save_for_backward``, so the active hooks pack them at the policy's
bits. There q and k keep the same feature dims exact (:func:`shared_exact_dims`), as the
layer route does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..compressors import IDENTITY, ChannelScaled, Compressor
from ..compressors.channel_scaled import exact_channels, joint_top, joint_top_and_amax
from ..saved_tensors.op_mode import outside_function_modes, plain_float, wants_grad
from .forward_state import forward_state, plain_saves, replayed
from .roles import OTHER
from .stash import choose, stash, unstash

__all__ = [
    "AttentionFunction",
    "attention",
    "scaled_dot_product_attention",
    "shared_exact_dims",
]

_SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SHARED = threading.local()  # .pairs: ((q or k, dims), ...) while hooks pack a call's q and k


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
    top, amax_q, amax_k = joint_top_and_amax(q, k, -1, q_.exact)
    # (the joint dims, not a layer's kept ones: their exponents are found with them)
    joint = {"top": top, "exponents": None, "scales": None}
    return replace(q_, amax=amax_q, **joint), replace(k_, amax=amax_k, **joint)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def shared_exact_dims(t: torch.Tensor) -> torch.Tensor | None:
    """The feature dims (of the last dim) the hooks keep exact in ``t`` because it is the q
    or k of an attention call now being saved, the same dims in both; else None."""
    for saved, dims in getattr(_SHARED, "pairs", ()):
        if _same_view(t, saved):
            return dims
    return None


@contextlib.contextmanager
def _sharing_dims(q: torch.Tensor, k: torch.Tensor) -> Iterator[None]:
    """Within the block, :func:`shared_exact_dims` names q's and k's dims of largest
    ``amax(q) * amax(k)`` (one per 256 features, at least one, never all)."""
    features = q.shape[-1]
    count = min(exact_channels(features), features - 1)
    if k.shape[-1] != features or count < 1:
        yield
        return
    with torch.no_grad():
        dims = joint_top(q, k, -1, count)
    outer = getattr(_SHARED, "pairs", ())
    _SHARED.pairs = (*outer, (q, dims), (k, dims))
    try:
        yield
    finally:
        _SHARED.pairs = outer


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
        ctx.hooked = layer is None
        if ctx.hooked:  # the active saved-tensor hooks pack q, k, v; the mask stays as it is
            ctx.save_for_backward(q, k, v)
            ctx.mask = mask_tensor
            return out
        # (each head's features are the channels an outlier sits in)
        q_, k_, v_ = (choose(layer, OTHER, t, channel_dim=-1) for t in (q, k, v))
        q_, k_ = _same_exact_dims(q, k, q_, k_)
        stash(ctx, layer, [(q, q_), (k, k_), (v, v_), (mask_tensor, IDENTITY)])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.hooked:
            q, k, v = ctx.saved_tensors
            mask = ctx.mask
        else:
            q, k, v, mask = unstash(ctx)
        if mask is None:
            mask = ctx.mask_value
        needs = ctx.needs_input_grad[:4]
        leaves = []
        for t, need in zip((q, k, v, mask), needs, strict=True):
            leaves.append(t.detach().requires_grad_(True) if need and t is not None else t)
        wanted = [t for t, need in zip(leaves, needs, strict=True) if need and t is not None]
        # (outside function modes: one that routes attention would route the rerun again)
        with torch.enable_grad(), plain_saves(), replayed(ctx.state), outside_function_modes():
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
    """``F.scaled_dot_product_attention`` with compressed saved inputs: at ``layer``'s level,
    or (``layer=None``) packed by the active saved-tensor hooks."""
    shared = _sharing_dims(q, k) if layer is None else contextlib.nullcontext()
    with shared:  # (the hooks pack what a Function saves when apply returns)
        return AttentionFunction.apply(
            q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), layer
        )


def scaled_dot_product_attention(args: tuple, kwargs: dict, layer: Any) -> Any:
    """An ``F.scaled_dot_product_attention(*args, **kwargs)`` call through
    :func:`attention` for ``layer``, or ``NotImplemented`` where it does not apply (no
    gradient wanted, subclassed or sparse tensors, unknown arguments)."""
    if len(args) > 3 + len(_SDPA_OPTIONS):
        return NotImplemented
    names = ("query", "key", "value")
    qkv = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    if set(kwargs) - {*names, *_SDPA_OPTIONS}:
        return NotImplemented
    if not all(plain_float(t) for t in qkv) or not wants_grad(*qkv):
        return NotImplemented
    options = dict(zip(_SDPA_OPTIONS, args[3:], strict=False))
    options.update((n, kwargs[n]) for n in _SDPA_OPTIONS if n in kwargs)
    mask = options.get("attn_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.layout == torch.strided):
        return NotImplemented
    return attention(*qkv, **options, layer=layer)
