"""act_hf.convert in training: the loss decreases, converted models retain less (small
configs and the real MiniLM), bf16 and autocast, gradient checkpointing and the Trainer
callback."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may touch the network

import pytest
import torch
from conftest import ZOO, bert, first_output, gpt2, minilm, minilm_inputs, param_grads, scalar_loss
from torch import nn
from transformers import BertForSequenceClassification

import act_hf
import actcore
from actcore import memory

MiB = 2**20


pytestmark = pytest.mark.usefixtures("offline_and_seeded")


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
    model = minilm()
    assert model.config._attn_implementation == "sdpa"  # what from_pretrained picks
    model.train()
    inputs = minilm_inputs(8, 128)
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
    model = minilm(attn_implementation="eager")
    model.eval()
    inputs = minilm_inputs(4, 24)
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


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_bf16(name):
    model, inputs = ZOO[name]()
    model.to(torch.bfloat16).eval()
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    ref = first_output(model, inputs)
    act_hf.convert(model, "L3")
    out = first_output(model, inputs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    scalar_loss(model, inputs).float().backward()
    grads = param_grads(model)
    assert grads and all(g.dtype == torch.bfloat16 for g in grads.values())
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum().item() for g in grads.values()) > 0


def test_autocast_bf16_matches_and_trains():
    model, inputs = bert()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = first_output(model, inputs)
    act_hf.convert(model, "L3")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = first_output(model, inputs)
        loss = out.float().pow(2).mean()
    assert torch.equal(out, ref)
    loss.backward()
    grads = param_grads(model)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


# --------------------------------------------------------------------------- training setups


def test_gradient_checkpointing():
    model, inputs = gpt2()
    model.eval()
    act_hf.convert(model, "L0")
    model(**inputs).loss.backward()
    ref = param_grads(model)
    model.zero_grad(set_to_none=True)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model(**inputs).loss.backward()
    got = param_grads(model)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], msg=key)
    model.zero_grad(set_to_none=True)
    act_hf.convert(model, "L3")
    loss = model(**inputs).loss
    loss.backward()
    assert all(torch.isfinite(g).all() for g in param_grads(model).values())


def test_trainer_with_callback(tmp_path):
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    model, _ = bert()
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
