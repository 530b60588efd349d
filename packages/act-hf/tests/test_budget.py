"""actcore.fit_budget on a Hugging Face decoder converted by act_hf: past what the levels
alone reach, the plan recomputes decoder layers; the forward stays bitwise the plain
model's (attention dropout replayed), the gradients close, the budget kept."""

from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import torch.nn.functional as F
from conftest import llama, param_grads

import act_hf
import actcore
from actcore import memory


def test_a_budget_past_the_coarsest_level_recomputes_decoder_layers():
    torch.manual_seed(0)
    plain, batch = llama("sdpa")
    model = act_hf.convert(copy.deepcopy(plain), level="L0")
    levels_only = actcore.fit_budget(model, batch, 2**40, recompute=False)
    budget = int(levels_only.smallest_bytes * 0.7)
    plan = actcore.fit_budget(model, batch, budget)
    assert plan.recompute and set(plan.recompute) <= {"model.layers.0", "model.layers.1"}
    assert plan.kept_bytes <= budget
    with memory.track(model) as report:
        out = model(**batch)
    del out
    assert report.retained_bytes == plan.kept_bytes
    plain.train()
    model.train()
    losses, grads = [], []
    for m in (plain, model):
        torch.manual_seed(3)  # the same attention-dropout draws
        loss = m(**batch).loss
        loss.backward()
        losses.append(loss)
        grads.append(param_grads(m))
    assert torch.equal(losses[0], losses[1])  # the forward is the plain model's, bitwise
    a = torch.cat([g.flatten() for g in grads[0].values()])
    b = torch.cat([grads[1][n].flatten() for n in grads[0]])
    assert F.cosine_similarity(a, b, dim=0) > 0.9


def test_a_peak_budget_bounds_the_whole_step_of_a_decoder_with_its_loss():
    """``bound="peak"`` backs up from the model output's ``loss``: the step the plan makes
    (forward and backward, gradients allocated before) peaks within the budget, as the
    profiler counts it, and keeps no more than a plan on the bytes kept alone would."""
    torch.manual_seed(0)
    plain, batch = llama("sdpa")
    model = act_hf.convert(copy.deepcopy(plain), level="L0")
    exact = actcore.budget.step_peak(model, lambda m: m(**batch))
    plan = actcore.fit_budget(model, batch, int(exact * 0.9), recompute=False, bound="peak")
    assert plan.bound == "peak" and plan.peak_bytes <= int(exact * 0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(0)

    def step() -> None:
        out = model(**batch)  # held through the backward, as a training loop holds it
        out.loss.backward()

    _, peak = memory.profiled_peak_bytes(step)
    assert peak == plan.peak_bytes
    on_kept = actcore.fit_budget(model, batch, int(exact * 0.9), recompute=False)
    assert plan.kept_bytes <= on_kept.kept_bytes
