"""Tests of the act-mm skeleton: packaging metadata, dependencies, environment isolation."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
from packaging.requirements import Requirement

import act_mm

DIST = "act-mm"
# The only runtime requirements act-mm may declare (canonical names).
RUNTIME_REQUIREMENTS = {"actcore", "mmengine"}
# Frameworks that installing act-mm must never pull in: the other adapters' ones, and
# mmcv/mmdet, which only the optional `openmmlab` extra brings (tox -e act-mm-openmmlab).
FOREIGN_FRAMEWORKS = ("transformers", "torch_geometric", "mmcv", "mmdet")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _runtime_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in importlib.metadata.requires(DIST) or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_version_matches_installed_metadata():
    assert act_mm.__version__ == importlib.metadata.version(DIST)


def test_declares_only_actcore_and_mmengine():
    assert {_canonical(r.name) for r in _runtime_requirements()} == RUNTIME_REQUIREMENTS


def test_installed_dependencies_satisfy_declared_ranges():
    for req in _runtime_requirements():
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)


def test_actcore_and_framework_are_importable():
    import actcore

    assert actcore.__version__ == importlib.metadata.version("actcore")

    from mmengine.registry import MODELS, Registry

    # act-mm registers its layers in this root registry.
    assert isinstance(MODELS, Registry)
    assert MODELS.name == "model"


@pytest.mark.skipif(
    os.environ.get("ACT_TOX_ENV") != DIST,
    reason="meaningful only in the env that installs act-mm alone (tox -e act-mm)",
)
@pytest.mark.parametrize("module", FOREIGN_FRAMEWORKS)
def test_env_has_no_foreign_framework(module):
    assert importlib.util.find_spec(module) is None, (
        f"{module} is installed in the act-mm env: a dependency of act-mm pulled it in"
    )
