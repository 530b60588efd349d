"""The modules of actcore import one another without cycles.

Every written import counts, at module level or inside a function: ``import a.b``,
``from .x import y`` (an edge to ``x``), ``from pkg import name`` where ``name`` is a
submodule (an edge to that submodule). Importing a package is an edge to its
``__init__``. The parent package that Python runs before a submodule is not counted, so
``from . import x`` in a submodule is an edge to ``x`` alone, while ``from .. import Name``
for a name defined in a package's ``__init__`` is an edge to that ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "actcore"


def _module_name(path: Path) -> str:
    """Dotted name of the module in ``path`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every actcore module by dotted name."""
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """Absolute name of the module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The actcore modules that ``name``'s written imports name."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, name, is_package)
            if source not in modules:
                continue
            submodules = {f"{source}.{a.name}" for a in node.names} & modules.keys()
            out |= submodules
            ancestor = name.startswith(source + ".")
            if not ancestor or len(submodules) < len(node.names):
                out.add(source)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the actcore modules it imports."""
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly-connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    lines = [f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in component]
    return f"cycle of {len(component)} modules:\n" + "\n".join(lines)


def test_graph_sees_known_edges() -> None:
    """The walker resolves relative, function-level and submodule imports."""
    graph = import_graph()
    assert {"actcore.config", "actcore.layers", "actcore.ops"} <= graph["actcore"]
    assert len(graph) > 50


@pytest.mark.parametrize(
    ("source", "importer", "is_package", "expected"),
    [
        ("from . import x", "actcore.a", False, "actcore"),
        ("from .x import y", "actcore.a", False, "actcore.x"),
        ("from .. import y", "actcore.ops.a", False, "actcore"),
        ("from ..x import y", "actcore.ops.a", False, "actcore.x"),
        ("from . import x", "actcore.ops", True, "actcore.ops"),
        ("from .x import y", "actcore.ops", True, "actcore.ops.x"),
        ("from actcore.x import y", "actcore.ops.a", False, "actcore.x"),
    ],
)
def test_relative_imports_resolve(source: str, importer: str, is_package: bool, expected: str):
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve(node, importer, is_package) == expected


def test_only_the_front_ends_import_the_package() -> None:
    """The core's modules import the modules that define what they use, never ``actcore``
    itself (its ``__init__`` only re-exports); the CLI and the benchmarks use the public API."""
    front_ends = ("actcore.cli", "actcore.bench")
    importers = sorted(
        name
        for name, targets in import_graph().items()
        if PACKAGE in targets and not name.startswith(front_ends)
    )
    assert not importers


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "actcore has import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


PACKAGES = Path(__file__).resolve().parents[2]
ADAPTERS = sorted(PACKAGES.glob("act-*/src/**/*.py"))
OPEN_MODULES = {"actcore.extend", "actcore.bench"}
"""What an adapter may import from besides ``actcore`` itself: the extension API, and the
benchmark package for its own ``bench`` command."""


def _adapter_uses(path: Path) -> list[str]:
    """Each actcore name ``path`` reaches, as ``module:name`` (``actcore:x`` for
    ``actcore.x`` and ``from actcore import x``)."""
    import actcore

    public = set(actcore.__all__) | {"extend"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            inner = (a.name for a in node.names if a.name.startswith(PACKAGE + "."))
            found += [f"{name}:*" for name in inner if name not in OPEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == PACKAGE:
                found += [f"actcore:{a.name}" for a in node.names if a.name not in public]
            elif node.module.startswith(PACKAGE + ".") and node.module not in OPEN_MODULES:
                found += [f"{node.module}:{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == PACKAGE
            and node.attr not in public
        ):
            found.append(f"actcore:{node.attr}")
    return found


def test_adapters_use_only_the_public_api() -> None:
    """act-hf, act-pyg and act-mm reach actcore through ``actcore``'s public names and
    :mod:`actcore.extend` only, so the core's layout can change under them."""
    names = {p.relative_to(PACKAGES).parts[0] for p in ADAPTERS}
    assert names == {"act-hf", "act-mm", "act-pyg"}, names
    private = {f"{p.relative_to(PACKAGES)}: {use}" for p in ADAPTERS for use in _adapter_uses(p)}
    assert not private, "adapters reach actcore's internals:\n" + "\n".join(sorted(private))


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore stays in its module: what another module needs is
    public there (``from .x import _y`` is refused, written anywhere in actcore)."""
    found = []
    for name, path in _modules().items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _resolve(node, name, is_package)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            found += [
                f"{name}: from {source} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_top_level_is_at_most_12_modules_beside_the_subpackages():
    """actcore's top level is its public face; each concept's modules sit in a subpackage."""
    top = sorted(p.stem for p in (SRC / PACKAGE).glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
