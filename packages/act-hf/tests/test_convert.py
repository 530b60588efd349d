"""Tests of act_hf.convert on BERT, GPT-2, ViT and Llama small configs: what it converts
and reports, outputs and gradients against the plain model, options and errors, Conv1D,
save/load and reconversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may touch the network

import pytest
import torch
import transformers
from conftest import ZOO, bert, first_output, gpt2, param_grads, scalar_loss
from torch import nn
from transformers import BertConfig, BertModel, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import act_hf
import actcore
from act_hf import attention as act_attention
from actcore import memory

pytestmark = pytest.mark.usefixtures("offline_and_seeded")


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
        from actcore.layers.attention import AttentionFunction

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
        ref = first_output(model, inputs)
    ref_grad_path = first_output(model, inputs)  # with autograd (its attention, torch layers)
    act_hf.convert(model, "L3")
    assert model.config._attn_implementation == impl
    core_calls = _CountCoreAttention(monkeypatch)
    out = first_output(model, inputs)  # grad enabled: the compressing paths run
    assert core_calls.n == (model.config.num_hidden_layers if impl == "sdpa" else 0)
    assert torch.equal(out, ref)
    assert torch.equal(out, ref_grad_path)
    with torch.no_grad():
        assert torch.equal(first_output(model, inputs), ref)
    if impl == "eager":
        act_hf.convert(model, "L3", attention="act_eager")
        calls = _CountCalls(monkeypatch)
        assert torch.equal(first_output(model, inputs), ref)
        assert calls.n == model.config.num_hidden_layers


@pytest.mark.parametrize("name", list(ZOO))
def test_l0_gradients_equal_eager(name):
    """At L0 nothing is quantized: the converted model's gradients are eager's (same ops)."""
    model, inputs = ZOO[name]()
    model.eval()
    scalar_loss(model, inputs).backward()
    ref = param_grads(model)
    model.zero_grad(set_to_none=True)
    act_hf.convert(model, "L0")
    scalar_loss(model, inputs).backward()
    got = param_grads(model)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], msg=key)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    grads = param_grads(model)
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
    scalar_loss(model, inputs).backward()
    exact = _flat_grads(model)
    act_hf.convert(model, "L2")
    scalar_loss(model, inputs).backward()
    assert _cos(_flat_grads(model), exact) > 0.95
    act_hf.convert(model, "L3")
    draws = []
    for _ in range(4):
        scalar_loss(model, inputs).backward()
        draws.append(_flat_grads(model))
    single = _cos(draws[0], exact)
    mean = _cos(torch.stack(draws).mean(0), exact)
    assert single > 0.6, single
    assert mean > max(single, 0.85), (single, mean)


# --------------------------------------------------------------------------- options, errors


def test_unknown_level_and_bad_options_raise():
    model, _ = bert()
    with pytest.raises(ValueError, match="unknown optimization level 'L9'"):
        act_hf.convert(model, "L9")
    with pytest.raises(ValueError, match=r"bits must be in 1\.\.4"):
        act_hf.convert(model, "L3", fewbit_bits=7)
    with pytest.raises(TypeError, match="exclude takes"):
        act_hf.convert(model, "L3", exclude=[3])
    assert not any(isinstance(m, actcore.QLayer) for m in model.modules())


def test_exclude_and_fewbit_bits():
    model, _ = bert()
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
    base, inputs = bert()
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
    model, inputs = gpt2()
    model.config.reorder_and_upcast_attn = True
    model = GPT2LMHeadModel(model.config).eval()
    ref = first_output(model, inputs)
    act_hf.convert(model, "L3", attention="act_eager")
    assert model.config._attn_implementation == "eager" == model.act_report.attention
    assert "reorder_and_upcast_attn" in model.act_report.left["<attention>"]
    assert torch.equal(first_output(model, inputs), ref)


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
            first = first_output(model, inputs)
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
    model, inputs = gpt2()
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
    assert torch.equal(first_output(fresh, inputs), first_output(model, inputs))
    # a new level applies to every layer
    act_hf.convert(model, "L1")
    levels = {m.act_level for m in model.modules() if isinstance(m, actcore.QLayer)}
    assert levels == {"L1"}
    assert model.act_report.fewbit_bits is None  # few-bit codes are opt-in


def test_transformers_version_in_declared_range():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    (req,) = [Requirement(r) for r in requires("act-hf") if r.startswith("transformers")]
    assert req.specifier.contains(transformers.__version__)
    assert Path(act_hf.__file__).name == "__init__.py"


def test_silu_activation_backward_calls_silu_backward(monkeypatch) -> None:
    """transformers' ``SiLUActivation`` (Llama's MLP) is recomputed from its kept input;
    its backward calls ``silu_backward`` on that input instead of rerunning ``F.silu`` to
    differentiate it: the same gradients bit for bit, one ``silu`` op fewer per step."""
    import copy

    from transformers.activations import SiLUActivation

    from actcore.config import config
    from actcore.layers import recompute

    monkeypatch.setattr(config, "min_numel", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), SiLUActivation(), nn.Linear(48, 4))
    act_hf.convert(model, "L3")
    assert type(model[1]).__name__.endswith("SiLUActivation")
    twin = copy.deepcopy(model)  # (the same rounding seeds to come)
    x = torch.randn(8, 16) * 3

    def step(m: nn.Module) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(1)
        with torch.profiler.profile() as prof:
            m(x).square().sum().backward()
        runs = sum(e.count for e in prof.key_averages() if e.key == "aten::silu")
        return [p.grad for p in m.parameters()], runs

    direct, runs_direct = step(model)
    monkeypatch.setitem(recompute._ACTIVATIONS, SiLUActivation, None)  # rerun it instead
    rerun, runs_rerun = step(twin)
    assert all(torch.equal(a, b) for a, b in zip(direct, rerun, strict=True))
    assert runs_direct == runs_rerun - 1
