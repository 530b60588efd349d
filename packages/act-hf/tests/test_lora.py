"""act_hf.convert of a peft LoRA model: frozen linears keep nothing, LoRA gradients stay
close, adapters save and load as peft does."""

from __future__ import annotations

import copy
import gc
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import act_hf
from actcore import memory

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def _lora_llama() -> torch.nn.Module:
    model = peft.get_peft_model(
        _llama(), peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:  # as after some training: lora_A's gradient is not zero
            torch.nn.init.normal_(p, std=0.02)
    return model


IDS = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1))
INPUTS = {"input_ids": IDS, "labels": IDS, "use_cache": False}


def _step(model: torch.nn.Module) -> tuple[int, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(**INPUTS)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    out.loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return held, torch.cat(grads).double()


def test_lora_keeps_4x_less_with_close_lora_gradients() -> None:
    plain = _lora_llama()
    model = act_hf.convert(copy.deepcopy(plain))
    assert model.act_report.converted  # base layers and adapters became Q-layers
    plain_bytes, plain_grads = _step(plain)
    _step(model)  # the first step
    held, grads = _step(model)
    assert plain_grads.numel() == sum(
        p.numel() for n, p in plain.named_parameters() if "lora_" in n
    )  # only the adapters train
    assert plain_bytes / held >= 4, plain_bytes / held
    cos = F.cosine_similarity(plain_grads, grads, dim=0).item()
    assert cos >= 0.95, cos


def test_frozen_base_layers_keep_nothing() -> None:
    model = act_hf.convert(_lora_llama())
    with memory.track(model) as rep:
        out = model(**INPUTS)
    base = {n: b for n, b in rep.by_module.items() if n.endswith("base_layer")}
    adapters = {n: b for n, b in rep.by_module.items() if ".lora_" in n}
    assert not any(base.values()), base
    assert adapters  # the adapters do keep their (compressed) inputs
    out.loss.backward()


def test_adapters_save_and_load_as_peft_does(tmp_path) -> None:
    model = act_hf.convert(_lora_llama())
    model(**INPUTS).loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01)  # trained adapters
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path)  # plain peft, no act_hf
    mine = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), name
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, loaded(input_ids=IDS).logits)


def test_the_fastest_plan_fits_a_budget_on_a_lora_model() -> None:
    """fit_budget(order="time") on a peft LoRA model converted at L2: within the budget,
    what it keeps is what it predicted, the forward is the plain model's, bitwise, and the
    adapters' gradients stay close."""
    import actcore

    plain = _lora_llama()
    model = act_hf.convert(copy.deepcopy(plain), level="L2")
    exact = actcore.fit_budget(model, INPUTS, "1000%", order="time").exact_bytes
    plan = actcore.fit_budget(model, INPUTS, int(0.3 * exact), order="time")
    assert plan.order == "time" and plan.kept_bytes <= plan.budget
    with memory.track(model) as report:
        out = model(**INPUTS)
    del out
    assert report.retained_bytes == plan.kept_bytes
    losses, grads = [], []
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = m(**INPUTS).loss
        loss.backward()
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert torch.equal(losses[0], losses[1])
    assert grads[0].numel() == grads[1].numel()  # only the adapters train, in both
    assert F.cosine_similarity(grads[0].double(), grads[1].double(), dim=0) > 0.95
