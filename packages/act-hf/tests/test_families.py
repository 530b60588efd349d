"""act_hf.convert at its default level on tiny configs of today's transformers families.

Each model, built from a 2-layer config with random weights (batch 4, 128 tokens, hidden
128, loss computed by the model from ``labels``), must keep >= 6x fewer bytes than the
plain model by an independent count (the CPU profiler's self memory of one training
forward), give the same eval and train outputs bitwise (train: same RNG), and gradients
with cosine >= 0.9 to the plain model's (measured on the second step, as in training: the
first one lets the loss find the language-model head).
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Callable

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn
from torch.profiler import ProfilerActivity, profile

import act_hf

B, S, H = 4, 128, 128
COMMON = dict(
    vocab_size=256,
    hidden_size=H,
    intermediate_size=4 * H,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=S,
)
GQA = dict(COMMON, num_key_value_heads=2)


def _decoder(model_cls, config_cls, **kw) -> Callable[[], nn.Module]:
    return lambda: model_cls(config_cls(**kw))


FAMILIES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "llama": (_decoder(tf.LlamaForCausalLM, tf.LlamaConfig, **GQA), "lm"),
    "mistral": (
        _decoder(tf.MistralForCausalLM, tf.MistralConfig, **GQA, sliding_window=64),
        "lm",
    ),
    "qwen2": (_decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config, **GQA), "lm"),
    "gemma": (_decoder(tf.GemmaForCausalLM, tf.GemmaConfig, **GQA, head_dim=32), "lm"),
    "phi": (
        _decoder(tf.PhiForCausalLM, tf.PhiConfig, **COMMON),
        "lm",
    ),
    "gpt2": (
        _decoder(tf.GPT2LMHeadModel, tf.GPT2Config, vocab_size=256, n_embd=H, n_layer=2, n_head=4),
        "lm",
    ),
    "gpt_neox": (_decoder(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, **COMMON), "lm"),
    "bert": (_decoder(tf.BertForMaskedLM, tf.BertConfig, **COMMON), "masked"),
    "roberta": (
        _decoder(
            tf.RobertaForMaskedLM, tf.RobertaConfig, **dict(COMMON, max_position_embeddings=S + 2)
        ),
        "masked",
    ),
    "distilbert": (
        _decoder(
            tf.DistilBertForMaskedLM,
            tf.DistilBertConfig,
            vocab_size=256,
            dim=H,
            hidden_dim=4 * H,
            n_layers=2,
            n_heads=4,
            max_position_embeddings=S,
        ),
        "masked",
    ),
    "opt": (
        _decoder(
            tf.OPTForCausalLM,
            tf.OPTConfig,
            vocab_size=256,
            hidden_size=H,
            ffn_dim=4 * H,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=S,
            word_embed_proj_dim=H,
        ),
        "lm",
    ),
    "bart": (
        _decoder(
            tf.BartForConditionalGeneration,
            tf.BartConfig,
            vocab_size=256,
            d_model=H,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=4 * H,
            decoder_ffn_dim=4 * H,
            max_position_embeddings=S,
        ),
        "seq2seq",
    ),
    "t5": (
        _decoder(
            tf.T5ForConditionalGeneration,
            tf.T5Config,
            vocab_size=256,
            d_model=H,
            d_kv=32,
            d_ff=4 * H,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        "seq2seq",
    ),
    "vit": (
        _decoder(
            tf.ViTForImageClassification,
            tf.ViTConfig,
            image_size=64,
            patch_size=4,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=4 * H,
            num_labels=10,
        ),
        "image",
    ),
    # beyond the list: built from the same parts (GQA, sliding windows, soft-capping, q/k
    # norms, gelu-tanh MLPs, parallel blocks, norms after the sublayers)
    "olmo2": (_decoder(tf.Olmo2ForCausalLM, tf.Olmo2Config, **GQA), "lm"),
    "gemma2": (_decoder(tf.Gemma2ForCausalLM, tf.Gemma2Config, **GQA, head_dim=32), "lm"),
    "phi3": (_decoder(tf.Phi3ForCausalLM, tf.Phi3Config, **GQA, pad_token_id=0), "lm"),
    "qwen3": (_decoder(tf.Qwen3ForCausalLM, tf.Qwen3Config, **GQA, head_dim=32), "lm"),
    "starcoder2": (_decoder(tf.Starcoder2ForCausalLM, tf.Starcoder2Config, **GQA), "lm"),
    "falcon": (
        _decoder(
            tf.FalconForCausalLM,
            tf.FalconConfig,
            vocab_size=256,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
        "lm",
    ),
}


def _inputs(kind: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {
            "pixel_values": torch.randn(B, 3, 64, 64, generator=g),
            "labels": torch.randint(0, 10, (B,), generator=g),
        }
    ids = torch.randint(0, 256, (B, S), generator=g)
    inputs = {"input_ids": ids, "labels": ids}
    if kind != "lm":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, 100:] = 0  # padding: the attention mask matters
        inputs["attention_mask"] = mask
    if kind in ("lm", "seq2seq"):
        inputs["use_cache"] = False  # as in training: no key/value cache returned
    return inputs


def _profiled(model: nn.Module, inputs: dict):
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(**inputs)
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_keeps_6x_less_same_forward_close_gradients(name: str) -> None:
    make, kind = FAMILIES[name]
    inputs = _inputs(kind)
    torch.manual_seed(0)
    plain = make()
    model = copy.deepcopy(plain)
    act_hf.convert(model)
    plain.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(plain(**inputs).logits, model(**inputs).logits)
    plain.train()
    model.train()
    model(**inputs).loss.backward()  # the first step
    model.zero_grad(set_to_none=True)

    torch.manual_seed(1)
    plain_bytes, plain_out = _profiled(plain, inputs)
    plain_out.loss.backward()
    torch.manual_seed(1)
    held, out = _profiled(model, inputs)
    assert torch.equal(out.logits, plain_out.logits)  # train mode, same dropout masks
    out.loss.backward()
    ratio = plain_bytes / held
    cos = F.cosine_similarity(_grads(plain).double(), _grads(model).double(), dim=0).item()
    assert ratio >= 6, f"{name}: {ratio:.2f}x"
    assert cos >= 0.9, f"{name}: gradient cosine {cos:.3f}"


def test_checkpointing_and_convert_keep_2x_less_than_checkpointing() -> None:
    """With per-layer activation checkpointing, what checkpointing keeps (each layer's input)
    is compressed: >= 2x fewer bytes than checkpointing alone, gradients close."""
    make, _ = FAMILIES["llama"]
    inputs = _inputs("lm")
    torch.manual_seed(0)
    plain = make()
    plain.gradient_checkpointing_enable()
    plain.train()
    model = act_hf.convert(copy.deepcopy(plain))
    model(**inputs).loss.backward()  # the first step
    model.zero_grad(set_to_none=True)
    ckpt_bytes, ckpt_out = _profiled(plain, inputs)
    ckpt_out.loss.backward()
    held, out = _profiled(model, inputs)
    assert torch.equal(out.loss, ckpt_out.loss)
    out.loss.backward()
    cos = F.cosine_similarity(_grads(plain).double(), _grads(model).double(), dim=0).item()
    assert ckpt_bytes / held >= 2, ckpt_bytes / held
    assert cos >= 0.95, cos


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_bf16_autocast_same_forward_and_trains(name: str) -> None:
    """Under bf16 autocast (rotary cos/sin in fp32 meet bf16 projections: the attention's
    inputs arrive in mixed dtypes and autocast unifies them), the forward is the plain
    model's and the recomputations in backward run under the same autocast."""
    make, kind = FAMILIES[name]
    inputs = _inputs(kind)
    torch.manual_seed(0)
    plain = make()
    model = act_hf.convert(copy.deepcopy(plain))
    plain.eval()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(plain(**inputs).logits, model(**inputs).logits)
    plain.train()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs).loss.backward()  # the first step
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        plain_bytes, plain_out = _profiled(plain, inputs)
        torch.manual_seed(1)
        held, out = _profiled(model, inputs)
    assert torch.equal(out.loss, plain_out.loss)
    plain_out.loss.backward()
    out.loss.backward()
    grads = _grads(model)
    assert torch.isfinite(grads).all()
    cos = F.cosine_similarity(_grads(plain).double(), grads.double(), dim=0).item()
    assert plain_bytes / held >= 4, plain_bytes / held
    assert cos >= 0.9, cos


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "bart", "t5"])
def test_family_compiles_in_training(name: str) -> None:
    """Converted, then compiled in training mode (attention dropout on, as GPT-2, BERT, BART
    and T5 have it): no graph break the plain model does not have, the compiled plain
    model's loss bitwise under one seed, finite gradients."""
    build, kind = FAMILIES[name]
    inputs = _inputs(kind)
    torch.manual_seed(0)
    plain = build()
    model = act_hf.convert(copy.deepcopy(plain))
    losses, breaks = [], []
    for m in (plain, model):
        m.train()
        torch._dynamo.reset()
        breaks.append(torch._dynamo.explain(lambda m=m: m(**inputs).loss)().graph_break_count)
        torch._dynamo.reset()
        fn = torch.compile(m, backend="aot_eager")
        torch.manual_seed(1)
        loss = fn(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
    assert breaks[1] == breaks[0], breaks
    assert torch.equal(losses[1], losses[0])
    assert torch.isfinite(_grads(model)).all()
