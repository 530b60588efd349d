"""Tests of the act-pyg skeleton: packaging metadata, dependencies, environment isolation."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch
from packaging.requirements import Requirement

import act_pyg

DIST = "act-pyg"
# The only runtime requirements act-pyg may declare (canonical names).
RUNTIME_REQUIREMENTS = {"actcore", "torch-geometric"}
# Frameworks that installing act-pyg must never pull in (the other adapters' ones).
FOREIGN_FRAMEWORKS = ("mmengine", "mmcv", "transformers")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _runtime_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in importlib.metadata.requires(DIST) or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_version_matches_installed_metadata():
    assert act_pyg.__version__ == importlib.metadata.version(DIST)


def test_declares_only_actcore_and_torch_geometric():
    assert {_canonical(r.name) for r in _runtime_requirements()} == RUNTIME_REQUIREMENTS


def test_installed_dependencies_satisfy_declared_ranges():
    for req in _runtime_requirements():
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)


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
