"""Tests of the act-mm skeleton: its framework imports and its env holds no other adapter's
framework (package metadata: tests/test_packages.py at the root, in the integration env)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

DIST = "act-mm"
# Frameworks that installing act-mm must never pull in: the other adapters' ones, and
# mmcv/mmdet, which only the optional `openmmlab` extra brings (tox -e act-mm-openmmlab).
FOREIGN_FRAMEWORKS = ("transformers", "torch_geometric", "mmcv", "mmdet")


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
