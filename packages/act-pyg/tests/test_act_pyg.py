"""Tests of the act-pyg skeleton: its framework imports and its env holds no other adapter's
framework (package metadata: tests/test_packages.py at the root, in the integration env)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch

DIST = "act-pyg"
# Frameworks that installing act-pyg must never pull in (the other adapters' ones).
FOREIGN_FRAMEWORKS = ("mmengine", "mmcv", "transformers")


def test_actcore_and_framework_are_importable():
    import actcore

    assert actcore.__version__ == importlib.metadata.version("actcore")

    from torch_geometric.nn import GATConv, GCNConv, MessagePassing, SAGEConv

    # act-pyg swaps these convolutions; all are message-passing torch modules.
    for conv in (GCNConv, SAGEConv, GATConv):
        assert issubclass(conv, MessagePassing)
        assert issubclass(conv, torch.nn.Module)


@pytest.mark.skipif(
    os.environ.get("ACT_TOX_ENV") != DIST,
    reason="meaningful only in the env that installs act-pyg alone (tox -e act-pyg)",
)
@pytest.mark.parametrize("module", FOREIGN_FRAMEWORKS)
def test_env_has_no_foreign_framework(module):
    assert importlib.util.find_spec(module) is None, (
        f"{module} is installed in the act-pyg env: a dependency of act-pyg pulled it in"
    )
