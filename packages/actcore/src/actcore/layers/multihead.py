"""``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` runs) with compressed
attention: the same projections, reshapes and sdpa call, the sdpa call through
:class:`actcore.layers.attention.AttentionFunction`.

torch computes attention inside that function, out of reach of a function mode, so the
routed version repeats its steps for the calls it covers: batched inputs, one packed
in-projection weight (``embed_dim == kdim == vdim``), no ``bias_k``/``bias_v``,
``add_zero_attn``, ``static_k``/``static_v``, and ``need_weights=False`` (what
``nn.TransformerEncoderLayer`` and torchvision's ViT pass). Every other call runs torch's
own function (its saved tensors then go through the hooks as any other op's). The steps
are the same ops on the same tensors in the same order, so the output is bitwise torch's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from ..saved_tensors.op_mode import plain_tensor, wants_grad
from .attention import attention

__all__ = ["multi_head_attention"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_HELPERS = ("_canonical_mask", "_none_or_dtype", "_in_projection_packed")


def _covered(a: dict[str, Any]) -> bool:
    query, key, value = a["query"], a["key"], a["value"]
    if not all(hasattr(F, name) for name in _HELPERS):
        return False
    if a["need_weights"] or a["use_separate_proj_weight"] or a["add_zero_attn"]:
        return False
    if any(a[n] is not None for n in ("bias_k", "bias_v", "static_k", "static_v")):
        return False
    if a["in_proj_weight"] is None or query.dim() != 3 or key.dim() != 3:
        return False
    if key.shape != value.shape or query.shape[-1] != a["embed_dim_to_check"]:
        return False
    if query.shape[1] != key.shape[1] or query.shape[-1] % a["num_heads"]:
        return False
    # is_causal without a mask: torch raises its own error
    return not (a["is_causal"] and a["attn_mask"] is None)


def multi_head_attention(layer: Any, args: tuple, kwargs: dict) -> Any:
    """``F.multi_head_attention_forward(*args, **kwargs)`` with compressed attention (at
    ``layer``'s level, or packed by the active hooks for ``None``), or ``NotImplemented``
    for calls outside the covered ones (see the module docstring) or without a gradient."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not wants_grad(*tensors):
        return NotImplemented
    if not all(plain_tensor(t) for t in tensors):
        return NotImplemented

    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    bound.apply_defaults()
    a = bound.arguments
    if not _covered(a):
        return NotImplemented
    query, key, value = a["query"], a["key"], a["value"]
    heads = a["num_heads"]
    tgt_len, bsz, embed_dim = query.shape
    head_dim = embed_dim // heads
    attn_mask, is_causal = a["attn_mask"], a["is_causal"]
    padding = F._canonical_mask(
        mask=a["key_padding_mask"],
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and padding is None:
        attn_mask = None  # sdpa's own causal mask
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if padding is not None:
            is_causal = False
    q, k, v = F._in_projection_packed(query, key, value, a["in_proj_weight"], a["in_proj_bias"])
    src_len = k.shape[0]
    if attn_mask is not None:
        if attn_mask.dim() == 2 and attn_mask.shape == (tgt_len, src_len):
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.shape != (bsz * heads, tgt_len, src_len):
            return NotImplemented  # torch raises its own error
    q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
    k = k.view(src_len, bsz * heads, head_dim).transpose(0, 1)
    v = v.view(src_len, bsz * heads, head_dim).transpose(0, 1)
    if padding is not None:
        if padding.shape != (bsz, src_len):
            return NotImplemented
        padding = padding.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1)
        padding = padding.reshape(bsz * heads, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, heads, -1, src_len)
    q = q.view(bsz, heads, tgt_len, head_dim)
    k = k.view(bsz, heads, src_len, head_dim)
    v = v.view(bsz, heads, src_len, head_dim)
    out = attention(q, k, v, attn_mask, dropout_p, is_causal, layer=layer)
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"])
    return out.view(tgt_len, bsz, out.size(1)), None
