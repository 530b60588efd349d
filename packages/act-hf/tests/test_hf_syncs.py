"""No host synchronisation added to a steady training step of a converted decoder (the
speed issue): a Llama under act_hf's default level, with sdpa and the loss from ``labels``,
reads back from the device exactly what the unconverted model reads (transformers' own mask
code reads one value a forward), except on the steps that replan its adaptive bits.
Counted with the profiler on CPU, where these ops are the same calls."""

from __future__ import annotations

import copy

import torch
from conftest import llama

import act_hf
from actcore.bench.calls import count_calls

INTERVAL = 5  # adaptive bits replan every 5 steps here
STEPS = 11


def test_llama_steady_steps_add_no_synchronisation() -> None:
    torch.manual_seed(0)
    plain, inputs = llama("sdpa")
    plain.train()
    model = act_hf.convert(copy.deepcopy(plain))
    model.act_adaptive.interval = INTERVAL

    def step(m: torch.nn.Module) -> None:
        m(**inputs, use_cache=False).loss.backward()

    step(plain)  # (past any first-call work)
    own = count_calls(lambda: step(plain))[1]
    counts = [count_calls(lambda: step(model))[1] for _ in range(STEPS)]
    replans = {i for i in range(STEPS) if (i + 1) % INTERVAL == 0}
    steady = {i: c for i, c in enumerate(counts) if i not in replans and c != own}
    assert steady == {}, (own, steady)
    assert all(counts[i] != own for i in replans)  # (the replans read their statistics back)
