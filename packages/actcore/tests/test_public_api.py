"""Every public actcore module says what it exports: an ``__all__`` of names it has."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import actcore


def public_modules() -> list[str]:
    """actcore and its modules whose dotted names have no part starting with ``_``."""
    names = [actcore.__name__]
    for info in pkgutil.walk_packages(actcore.__path__, prefix="actcore."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def test_public_modules_are_found() -> None:
    found = public_modules()
    assert {
        "actcore",
        "actcore.saved_tensors.hooks",
        "actcore.ops.api",
        "actcore.bench.report",
    } <= set(found)
    assert "actcore.fewbit.__main__" not in found


@pytest.mark.parametrize("name", public_modules())
def test_module_has_all_of_existing_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
