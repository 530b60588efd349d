"""Tests of the act-hf skeleton: packaging metadata, dependencies, environment isolation."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch
from packaging.requirements import Requirement

import act_hf

DIST = "act-hf"
# The only runtime requirements act-hf may declare (canonical names).
RUNTIME_REQUIREMENTS = {"actcore", "transformers"}
# Frameworks that installing act-hf must never pull in (the other adapters' ones).
FOREIGN_FRAMEWORKS = ("mmengine", "mmcv", "torch_geometric")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _runtime_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in importlib.metadata.requires(DIST) or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_version_matches_installed_metadata():
    assert act_hf.__version__ == importlib.metadata.version(DIST)


def test_declares_only_actcore_and_transformers():
    assert {_canonical(r.name) for r in _runtime_requirements()} == RUNTIME_REQUIREMENTS


def test_installed_dependencies_satisfy_declared_ranges():
    for req in _runtime_requirements():
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)


def test_transformers_range_admits_4x_and_5x():
    (req,) = [r for r in _runtime_requirements() if _canonical(r.name) == "transformers"]
    assert req.specifier.contains("4.57.0")
    assert req.specifier.contains("5.23.0")


def test_actcore_and_framework_are_importable():
    import actcore

    assert actcore.__version__ == importlib.metadata.version("actcore")

    import transformers

    # act-hf converts PreTrainedModels, which are torch modules.
    assert issubclass(transformers.PreTrainedModel, torch.nn.Module)


@pytest.mark.skipif(
    os.environ.get("ACT_TOX_ENV") != DIST,
    reason="meaningful only in the env that installs act-hf alone (tox -e act-hf)",
)
@pytest.mark.parametrize("module", FOREIGN_FRAMEWORKS)
def test_env_has_no_foreign_framework(module):
    assert importlib.util.find_spec(module) is None, (
        f"{module} is installed in the act-hf env: a dependency of act-hf pulled it in"
    )
