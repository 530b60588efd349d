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
# All that each package may require at run time (canonical names): an adapter brings
# actcore and its one framework, nothing of the others'. (actcore's command line needs rich
# and matplotlib too: its `cli` extra. typing-extensions, which torch requires anyway,
# gives actcore.deprecation PEP 702's decorator.)
RUNTIME = {
    "actcore": {"torch", "numpy", "typing-extensions"},
    "act-mm": {"actcore", "mmengine"},
    "act-hf": {"actcore", "transformers"},
    "act-pyg": {"actcore", "torch-geometric"},
}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _runtime_requirements(dist: str) -> list:
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in importlib.metadata.requires(dist) or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


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


@pytest.mark.parametrize("dist", sorted(EXPECTED))
def test_declares_only_its_runtime_requirements(dist):
    assert {_canonical(r.name) for r in _runtime_requirements(dist)} == RUNTIME[dist]


@pytest.mark.parametrize("dist", sorted(EXPECTED))
def test_installed_dependencies_satisfy_declared_ranges(dist):
    for req in _runtime_requirements(dist):
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)


@pytest.mark.parametrize("dist", sorted(EXPECTED - {"actcore"}))
def test_adapters_accept_this_actcore(dist):
    (core,) = [r for r in _runtime_requirements(dist) if r.name == "actcore"]
    assert core.specifier.contains(PROJECTS["actcore"]["version"])


def test_act_hf_transformers_range_admits_4x_and_5x():
    (req,) = [r for r in _runtime_requirements("act-hf") if r.name == "transformers"]
    assert req.specifier.contains("4.57.0")
    assert req.specifier.contains("5.23.0")


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
