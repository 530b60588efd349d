"""Renamed modules and attributes keep working for a release, with a DeprecationWarning,
and compressors live one per module."""

from __future__ import annotations

import importlib
import sys

import pytest
from torch import nn

import actcore
from actcore import compressors, saved_tensor_hooks, stash
from actcore.policy_scheme import PolicyScheme
from actcore.scope import ModelScope


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [("engine", stash, "actcore.stash"), ("hooks", saved_tensor_hooks, "saved_tensor_hooks")],
)
def test_old_module_names_warn_and_give_the_new_module(monkeypatch, old, new, where) -> None:
    monkeypatch.delitem(sys.modules, f"actcore.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=where):
        module = importlib.import_module(f"actcore.{old}")
    assert module is new
    assert getattr(actcore, old) is new  # actcore.engine, actcore.hooks as attributes too


def test_old_imports_from_the_hooks_module_still_work(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "actcore.hooks", raising=False)
    with pytest.warns(DeprecationWarning, match="moved to actcore.compressors"):
        from actcore.hooks import MaskBits, SavedTensorCompressor, SeededQuantize
    assert MaskBits is compressors.MaskBits and SeededQuantize is compressors.SeededQuantize
    assert SavedTensorCompressor is saved_tensor_hooks.SavedTensorHooks


def test_the_saved_tensor_hooks_old_class_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="renamed SavedTensorHooks"):
        old = saved_tensor_hooks.SavedTensorCompressor
    assert old is saved_tensor_hooks.SavedTensorHooks
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        saved_tensor_hooks.Missing  # noqa: B018


def test_policy_scheme_from_convert_warns() -> None:
    with pytest.warns(DeprecationWarning, match="actcore.policy_scheme"):
        from actcore.convert import PolicyScheme as old
    assert old is PolicyScheme


def test_engine_attributes_warn_and_name_the_saved_tensor_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    controller = actcore.Controller(model, "L1")
    with pytest.warns(DeprecationWarning, match="saved_tensor_hooks"):
        assert controller.engine is controller.saved_tensor_hooks
    actcore.convert(model, "L2")
    scope = model.act_scope
    assert isinstance(scope, ModelScope)
    with pytest.warns(DeprecationWarning, match="saved_tensor_hooks"):
        assert scope.engine is scope.saved_tensor_hooks
    assert isinstance(scope.saved_tensor_hooks, saved_tensor_hooks.SavedTensorHooks)


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
