"""A small character-level language model, in two styles, for ``bench train``.

``arch="gpt"``: pre-LayerNorm blocks, learned positions, causal
``F.scaled_dot_product_attention``, a GELU MLP and tied input/output embeddings.
``arch="llama"``: the same sizes with ``nn.RMSNorm``, rotary position embeddings applied
to q and k, a SwiGLU MLP (``F.silu(gate) * up``), no biases and an untied output layer.
``forward(idx, targets)`` returns the mean cross-entropy (``F.cross_entropy``) when
``targets`` is given, else the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ARCHS",
    "Block",
    "CharGPT",
    "GPTConfig",
    "GeluMLP",
    "SelfAttention",
    "SwiGLU",
    "apply_rotary",
    "rotary_tables",
]

ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`CharGPT` (the defaults: 4 layers, 4 heads, width 128, context 64)."""

    vocab_size: int
    context: int = 64
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0
    arch: str = "gpt"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; valid: {', '.join(ARCHS)}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        if (self.width // self.heads) % 2:
            raise ValueError(f"head size {self.width // self.heads} must be even for rotary")

    @property
    def ffn_hidden(self) -> int:
        """4x width for GELU; for SwiGLU 8/3 x width rounded up to 32 (similar parameters)."""
        if self.arch == "gpt":
            return 4 * self.width
        return 32 * math.ceil(8 * self.width / 3 / 32)


def rotary_tables(context: int, head_size: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (context, head_size // 2) for rotary position embeddings."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the (first half, second half) channel pairs of ``x`` (B, H, T, D) by position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        bias = cfg.arch == "gpt"
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.rotary = cfg.arch == "llama"
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=bias)
        self.out = nn.Linear(cfg.width, cfg.width, bias=bias)
        if self.rotary:
            cos, sin = rotary_tables(cfg.context, cfg.width // cfg.heads)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.rotary:
            cos, sin = self.cos[:t], self.sin[:t]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class GeluMLP(nn.Module):
    """Linear, GELU, Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.width, cfg.ffn_hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.ffn_hidden, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.width, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.width, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.width) if cfg.arch == "gpt" else nn.RMSNorm(cfg.width)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = SelfAttention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = GeluMLP(cfg) if cfg.arch == "gpt" else SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharGPT(nn.Module):
    """A decoder-only transformer over characters (see the module docstring)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width) if cfg.arch == "gpt" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual branches start small
            if name.endswith(("attn.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))
        if cfg.arch == "gpt":
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.cfg.context}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
