"""act-hf's attention: act_eager against the models' eager attention (outputs, mask
gradients, memory, fallback) and a model's sdpa kept by act_hf.convert."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may touch the network

import pytest
import torch
from conftest import ZOO, first_output, param_grads, scalar_loss
from torch import nn

import act_hf
from actcore import memory
from actcore.config import level_spec

pytestmark = pytest.mark.usefixtures("offline_and_seeded")


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_sdpa_still_works(name):
    model, inputs = ZOO[name]("sdpa")
    model.eval()
    ref = first_output(model, inputs)
    act_hf.convert(model, "L3", attention=False)
    assert model.config._attn_implementation == "sdpa"
    assert model.act_report.attention == "sdpa"
    out = first_output(model, inputs)
    assert torch.equal(out, ref)
    scalar_loss(model, inputs).backward()
    assert all(torch.isfinite(g).all() for g in param_grads(model).values())
    # converted with act_eager (opt-in), then switched back to sdpa by the user
    act_hf.convert(model, "L3", attention="act_eager")
    assert model.config._attn_implementation == "act_eager"
    torch.testing.assert_close(first_output(model, inputs), ref)  # eager math vs sdpa kernels
    model.set_attn_implementation("sdpa")
    assert torch.equal(first_output(model, inputs), ref)


# --------------------------------------------------------------------------- attention


def _bert_eager():
    from transformers.models.bert.modeling_bert import eager_attention_forward

    return eager_attention_forward


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_attention_function_matches_eager_with_mask_grad(p):
    """Against BERT's own eager function: same output (dropout included, same random
    stream), same gradients for q, k, v and a learned additive mask, at L0."""
    module = nn.Module()
    module.train()
    module.act_attention_spec = level_spec("L0")
    shape = (2, 3, 10, 8)
    base = [torch.randn(shape) for _ in range(3)]
    bias = torch.randn(1, 3, 10, 10)
    runs = []
    for fn in (_bert_eager(), act_hf.act_eager_attention_forward):
        q, k, v = (t.clone().requires_grad_() for t in base)
        mask = bias.clone().requires_grad_()
        torch.manual_seed(1)
        out, weights = fn(module, q, k, v, mask, scaling=0.3, dropout=p)
        (out.pow(2).sum() + weights.sum() * 0.5).backward()
        runs.append((out, weights, q.grad, k.grad, v.grad, mask.grad))
    for ref, got in zip(*runs, strict=True):
        torch.testing.assert_close(got, ref)
    assert torch.equal(runs[0][0], runs[1][0])


def test_attention_keeps_less():
    module = nn.Module()
    module.train()
    q, k, v = (torch.randn(4, 4, 64, 32, requires_grad=True) for _ in range(3))
    held = {}
    for level in ("L0", "L3"):
        module.act_attention_spec = level_spec(level)
        with memory.track() as report:
            out, _ = act_hf.act_eager_attention_forward(module, q, k, v, None, dropout=0.1)
            memory.note_outputs(out)
        held[level] = report.retained_bytes
        out.sum().backward()
    # L0: q, k, v, probabilities in fp32 and a 1-bit dropout mask; L3: all quantized
    n_qkv, n_p = 3 * 4 * 4 * 64 * 32, 4 * 4 * 64 * 64
    assert held["L0"] == 4 * (n_qkv + n_p) + n_p // 8
    assert held["L3"] < held["L0"] / 6


def test_unsupported_attention_call_falls_back_to_eager(caplog):
    module = nn.Module()
    module.eval()
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4)
    head_mask = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)

    def own_eager(module, query, key, value, attention_mask, scaling, dropout, head_mask=None):
        return torch.full_like(query, 7.0), None

    sys.modules[__name__].eager_attention_forward = own_eager  # "the model file's" function
    try:
        module.__class__ = type("FakeAttention", (nn.Module,), {"__module__": __name__})
        out, _ = act_hf.act_eager_attention_forward(
            module, q, k, v, mask, 1.0, 0.0, head_mask=head_mask
        )
    finally:
        del sys.modules[__name__].eager_attention_forward
    assert torch.equal(out, torch.full_like(q, 7.0))
