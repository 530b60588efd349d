"""What act-pyg's test modules share: the conv kinds, a small random graph and a seeded
stock/converted model pair, imported as ``from conftest import KINDS, stock_and_converted``
(this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch_geometric.data import Data

import act_pyg
from act_pyg import bench

KINDS = ("gcn", "sage", "gat")


@pytest.fixture(scope="module")
def small() -> Data:
    """A random graph: 300 nodes, 2,000 edges, 16 features."""
    return bench.random_graph(300, 2000, 16, seed=3)


def stock_and_converted(make, level="L0", dtype=torch.float32, **kwargs):
    """``make()`` (seeded, in ``dtype``) and a converted deep copy of it at ``level``."""
    torch.manual_seed(1)
    stock = make().to(dtype)
    conv = act_pyg.convert(copy.deepcopy(stock), level, **kwargs)
    return stock, conv
