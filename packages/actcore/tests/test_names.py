"""Renamed modules and attributes have no aliases left (0.1.0, before any release), and
compressors live one per module."""

from __future__ import annotations

import importlib

import pytest
from torch import nn

import actcore
from actcore import compressors
from actcore.layers.scope import ModelScope
from actcore.policy_scheme import PolicyScheme
from actcore.saved_tensors import hooks as saved_tensor_hooks


@pytest.mark.parametrize("old", ["engine", "hooks"])
def test_the_pre_release_module_aliases_are_gone(old) -> None:
    """0.1.0 has no users to protect: the renamed modules (now ``layers.stash`` and
    ``saved_tensors.hooks``) have no warning aliases left."""
    with pytest.raises(ModuleNotFoundError, match=f"actcore.{old}"):
        importlib.import_module(f"actcore.{old}")
    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(actcore, old)


def test_the_pre_release_attribute_aliases_are_gone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    controller = actcore.Controller(model, "G1")
    assert not hasattr(controller, "engine")
    actcore.convert(model, "L2")
    scope = model.act_scope
    assert isinstance(scope, ModelScope) and not hasattr(scope, "engine")
    assert isinstance(scope.saved_tensor_hooks, saved_tensor_hooks.SavedTensorHooks)
    assert not hasattr(saved_tensor_hooks, "SavedTensorCompressor")
    assert not hasattr(importlib.import_module("actcore.convert"), "PolicyScheme")
    assert PolicyScheme.__module__ == "actcore.policy_scheme"


def test_each_compressor_lives_in_its_own_module() -> None:
    classes = [
        getattr(compressors, name)
        for name in compressors.__all__
        if isinstance(getattr(compressors, name), type)
        and issubclass(getattr(compressors, name), compressors.Compressor)
    ]
    modules = [cls.__module__ for cls in classes if cls is not compressors.Compressor]
    assert len(classes) == 11  # Compressor and ten kinds, ChannelScaled the newest
    assert len(set(modules)) == len(modules)
    assert all(m.startswith("actcore.compressors.") for m in modules)
    assert compressors.Compressor.__module__ == "actcore.compressors.base"
    from actcore.adaptive import ScoredPerSampleQuantize  # re-exported where it is used

    assert ScoredPerSampleQuantize is compressors.ScoredPerSampleQuantize
