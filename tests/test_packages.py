"""Cross-package checks, run in the tox env that installs all four packages together."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"actcore", "act-mm", "act-hf", "act-pyg"}


def _pyprojects() -> dict[str, dict]:
    found = {}
    for path in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(path.read_text())["project"]
        found[project["name"]] = {"dir": path.parent, **project}
    return found


PROJECTS = _pyprojects()


def test_the_four_packages_exist():
    assert set(PROJECTS) == EXPECTED


@pytest.mark.parametrize("dist", sorted(EXPECTED))
def test_versions_agree(dist):
    project = PROJECTS[dist]
    module = importlib.import_module(dist.replace("-", "_"))
    assert module.__version__ == project["version"]
    assert importlib.metadata.version(dist) == project["version"]


@pytest.mark.parametrize("dist", sorted(EXPECTED))
def test_imported_from_this_checkout(dist):
    """The env tests this working tree (editable installs), not a stale copy."""
    module = importlib.import_module(dist.replace("-", "_"))
    src = (PROJECTS[dist]["dir"] / "src").resolve()
    assert Path(module.__file__).resolve().is_relative_to(src)


@pytest.mark.parametrize("dist", sorted(EXPECTED - {"actcore"}))
def test_adapters_accept_this_actcore(dist):
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in importlib.metadata.requires(dist) or []]
    (core,) = [r for r in reqs if r.name == "actcore"]
    assert core.specifier.contains(PROJECTS["actcore"]["version"])


def test_all_packages_install_together_consistently():
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dist", sorted(EXPECTED))
def test_each_package_ships_the_root_license(dist):
    """Each package dir holds a copy of LICENSE so its wheel and sdist include it."""
    copy = PROJECTS[dist]["dir"] / "LICENSE"
    assert copy.read_bytes() == (ROOT / "LICENSE").read_bytes()
