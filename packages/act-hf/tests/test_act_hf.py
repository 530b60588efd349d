"""Tests of the act-hf skeleton: its framework imports and its env holds no other adapter's
framework (package metadata: tests/test_packages.py at the root, in the integration env)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch

DIST = "act-hf"
# Frameworks that installing act-hf must never pull in (the other adapters' ones).
FOREIGN_FRAMEWORKS = ("mmengine", "mmcv", "torch_geometric")


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
