"""No host synchronisation added to a steady training step of a converted graph network
(the speed issue): PyG's example GCN and GIN (functional dropout and relu) under act_pyg's
default level read back from the device no more than the unconverted models read (PyG's
own self-loop and normalisation code reads some), except on the steps that replan the
adaptive bits. Counted with the profiler on CPU, where these ops are the same calls."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import act_pyg
from act_pyg import bench
from actcore.bench.calls import count_calls

INTERVAL = 5  # adaptive bits replan every 5 steps here
STEPS = 11


@pytest.mark.parametrize("kind", ["gcn", "gin"])
def test_steady_steps_add_no_synchronisation(kind: str) -> None:
    data = bench.random_graph(300, 2000, 16, seed=3)
    y = torch.randint(0, 5, (300,))
    torch.manual_seed(0)
    plain = bench.EXAMPLES[kind](16, 32, 5)
    model = act_pyg.convert(copy.deepcopy(plain))
    model.act_adaptive.interval = INTERVAL

    def step(m: torch.nn.Module) -> None:
        F.cross_entropy(m(data.x, data.edge_index), y).backward()

    step(plain)  # (past any first-call work)
    own = Counter(count_calls(lambda: step(plain))[1])
    counts = [Counter(count_calls(lambda: step(model))[1]) for _ in range(STEPS)]
    replans = {i for i in range(STEPS) if (i + 1) % INTERVAL == 0}
    added = {i: c - own for i, c in enumerate(counts) if i not in replans and c - own}
    assert added == {}, (own, added)
    assert all(counts[i] - own for i in replans)  # (the replans read their statistics back)
