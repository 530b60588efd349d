"""``act_eager``: transformers' eager attention with its saved activations compressed.

Registered in transformers' ``AttentionInterface`` (and, where the installed transformers
has one, in the ``AttentionMaskInterface`` with the eager mask), so a model runs it after
``model.set_attn_implementation("act_eager")`` (what :func:`act_hf.convert` does).

The forward runs the very ops of the model's own ``eager_attention_forward``, in the same
order (``matmul(q, k^T) * scaling``, ``+ mask``, ``softmax``, the same dtype casts,
``dropout``, ``matmul(p, v)``), so outputs are bitwise those of ``eager``. Which casts a
model's eager function makes (softmax in float32 then back, or a cast to ``value``'s dtype)
is read from that function once per model family. What autograd would keep for backward
(q, k, v, the softmax probabilities twice, a byte per element of dropout mask) becomes:
q, k, v at the level's conv/linear bits, the probabilities once at
:func:`attention_bits` bits, and the dropout mask at 1 bit. Backward is the exact eager
backward on the restored tensors (so at a level without compression, gradients equal eager's).
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actcore import ops
from actcore.extend import (
    CONV,
    IDENTITY,
    Compressor,
    LevelSpec,
    Quantize,
    Swap,
    choose,
    config,
    dropout_backward,
    dropout_with_mask,
    layer_spec,
    needs_saving,
    stash,
    unstash,
)

log = logging.getLogger("act_hf")

__all__ = [
    "ATTENTION_NAME",
    "AttentionFunction",
    "act_eager_attention_forward",
    "attention_bits",
    "register_attention",
]

ATTENTION_NAME = "act_eager"
"""The name ``act_eager_attention_forward`` is registered under."""

aten = torch.ops.aten

# kwargs whose non-None value changes eager attention in ways act_eager does not compute
# (Gemma-2 logit soft-capping, GPT-OSS attention sinks, 4.x BERT head masks): those calls
# run the model's own eager function, uncompressed.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "head_mask")


def attention_bits(spec: LevelSpec) -> int | None:
    """Bits of the saved softmax probabilities at a level: None (kept as they are) when the
    level keeps linear inputs in full precision, else ``max(4, conv_bits)``.

    Probabilities enter the softmax backward twice (``p * (dp - sum(dp * p))``), so their
    error is not averaged out by stochastic rounding as a linear input's is; 4 bits keeps it
    small while costing an eighth of float32.
    """
    if spec.conv_bits is None:
        return None
    return max(4, spec.conv_bits)


def _probs_compressor(spec: LevelSpec, x: torch.Tensor) -> Compressor:
    bits = attention_bits(spec)
    if bits is None or x.numel() < config.min_numel:
        base: Compressor = IDENTITY
    else:
        base = Quantize(bits, config.group_size, stochastic=config.stochastic)
    return Swap(base) if spec.swap else base


_VARIANTS: dict[str, tuple[bool, bool]] = {}


def _eager_function(module: nn.Module) -> Callable[..., Any] | None:
    """The ``eager_attention_forward`` of the file that defines ``module``'s class."""
    source = sys.modules.get(type(module).__module__)
    fn = getattr(source, "eager_attention_forward", None)
    return fn if callable(fn) else None


def _variant(module: nn.Module) -> tuple[bool, bool]:
    """(softmax in float32 then back to q's dtype, cast probabilities to v's dtype) as in
    the eager function of ``module``'s model family (BERT: neither; GPT-2: the second;
    ViT, Llama: the first). Both are no-ops when everything has one dtype."""
    key = type(module).__module__
    found = _VARIANTS.get(key)
    if found is None:
        fn = _eager_function(module)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            src = ""
        upcast = "dtype=torch.float32" in src
        to_value = ".type(value.dtype)" in src or ".to(value.dtype)" in src
        found = _VARIANTS[key] = (upcast, to_value)
    return found


def _probabilities(scores: torch.Tensor, q_dtype, v_dtype, upcast: bool, to_value: bool):
    if upcast:
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q_dtype)
    else:
        probs = nn.functional.softmax(scores, dim=-1)
    if to_value:
        probs = probs.type(v_dtype)
    return probs


class AttentionFunction(torch.autograd.Function):
    """Eager attention ``(softmax(q k^T * scaling + mask) -> dropout) @ v`` whose saved
    tensors go through actcore's compressors. Returns ``(output, probabilities)``, both
    differentiable; the output is ``[batch, heads, q_len, head_dim]`` (not transposed)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling, p, upcast, to_value, holder):
        ctx.set_materialize_grads(False)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scaling
        ctx.qk_dtype = scores.dtype
        if mask is not None:
            scores = scores + mask
        probs = _probabilities(scores, q.dtype, v.dtype, upcast, to_value)
        dropped, drop_mask = dropout_with_mask(probs, p) if p > 0 else (probs, None)
        out = torch.matmul(dropped, v)
        ctx.meta = (scores.dtype, probs.dtype, out.dtype, q.dtype, k.dtype, v.dtype, upcast, p)
        ctx.mask_shape = None if mask is None else (mask.shape, mask.dtype)
        ctx.scaling = scaling
        spec = layer_spec(holder)
        packed_mask = None if drop_mask is None else ops.pack_mask(drop_mask)
        ctx.drop_shape = probs.shape
        stash(
            ctx,
            holder,
            [
                (q, choose(holder, CONV, q)),
                (k, choose(holder, CONV, k)),
                (v, choose(holder, CONV, v)),
                (probs, _probs_compressor(spec, probs)),
                (packed_mask, IDENTITY),
            ],
        )
        return out, dropped

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        q, k, v, probs, packed_mask = unstash(ctx)
        scores_dtype, probs_dtype, mm_dtype, q_dtype, k_dtype, v_dtype, upcast, p = ctx.meta
        need_q, need_k, need_v, need_mask = ctx.needs_input_grad[:4]
        drop_mask = None if packed_mask is None else ops.unpack_mask(packed_mask, ctx.drop_shape)
        gq = gk = gv = gmask = None
        d_dropped = None
        if grad_out is not None:
            g = grad_out.to(mm_dtype)
            if need_v:
                dropped = probs if drop_mask is None else dropout_backward(probs, drop_mask, p)
                gv = torch.matmul(dropped.to(mm_dtype).transpose(-2, -1), g).to(v_dtype)
            d_dropped = torch.matmul(g, v.to(mm_dtype).transpose(-2, -1)).to(probs_dtype)
        if grad_probs is not None:
            gp = grad_probs.to(probs_dtype)
            d_dropped = gp if d_dropped is None else d_dropped + gp
        if d_dropped is not None and (need_q or need_k or need_mask):
            d_probs = d_dropped if drop_mask is None else dropout_backward(d_dropped, drop_mask, p)
            soft_dtype = torch.float32 if upcast else scores_dtype
            d_scores = aten._softmax_backward_data(
                d_probs.to(soft_dtype), probs.to(soft_dtype), -1, scores_dtype
            )
            if need_mask:
                shape, dtype = ctx.mask_shape
                gmask = d_scores.sum_to_size(shape).to(dtype)
            d_qk = (d_scores * ctx.scaling).to(ctx.qk_dtype)
            if need_q:
                gq = torch.matmul(d_qk, k.to(d_qk.dtype)).to(q_dtype)
            if need_k:
                gk = torch.matmul(d_qk.transpose(-2, -1), q.to(d_qk.dtype)).to(k_dtype)
        return gq, gk, gv, gmask, None, None, None, None, None


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``n_rep`` query heads."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


_warned: set[str] = set()


def _fallback(module: nn.Module, why: str, *args: Any, **kwargs: Any):
    fn = _eager_function(module)
    if fn is None:
        raise RuntimeError(
            f"act_eager cannot compute attention for {type(module).__name__} ({why}) and its "
            "model file has no eager_attention_forward to fall back to; use "
            "attn_implementation='eager' or act_hf.convert(..., attention='keep')"
        )
    name = type(module).__name__
    if name not in _warned:
        _warned.add(name)
        log.warning("act_eager: %s runs its own eager attention, uncompressed (%s)", name, why)
    return fn(module, *args, **kwargs)


def act_eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``AttentionInterface`` function: eager attention, saved tensors compressed.

    Takes what transformers passes to ``eager_attention_forward``; the level is the
    module's ``act_attention_spec`` (set by :func:`act_hf.convert`), else actcore's
    process-wide level. Calls with a feature it does not compute (see
    ``_UNSUPPORTED_KWARGS``) run the model's own eager function, with a warning once.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return _fallback(
                module,
                f"{name} given",
                query,
                key,
                value,
                attention_mask,
                scaling,
                dropout,
                **kwargs,
            )
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return _fallback(
            module, "boolean mask", query, key, value, attention_mask, scaling, dropout, **kwargs
        )
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key = _repeat_kv(key, n_rep)
    value = _repeat_kv(value, n_rep)
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[-2]:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    p = dropout if module.training else 0.0
    upcast, to_value = _variant(module)
    if needs_saving(query, key, value, attention_mask):
        spec = getattr(module, "act_attention_spec", None) or config.spec
        holder = types.SimpleNamespace(act_spec=spec, act_scheme=None)
        out, weights = AttentionFunction.apply(
            query, key, value, attention_mask, scaling, p, upcast, to_value, holder
        )
    else:  # nothing to save: the same ops, no autograd function
        scores = torch.matmul(query, key.transpose(-2, -1)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = _probabilities(scores, query.dtype, value.dtype, upcast, to_value)
        weights = nn.functional.dropout(weights, p=p, training=p > 0)
        out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), weights


def register_attention() -> bool:
    """Register ``act_eager`` in transformers' attention (and mask) interfaces, once.

    Returns False when the installed transformers has no ``AttentionInterface``.
    """
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers older than the attention interface
        return False
    AttentionInterface.register(ATTENTION_NAME, act_eager_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, eager_mask
    except ImportError:  # masks built by each model from config._attn_implementation
        return True
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    return True
