#!/usr/bin/env python3
"""Build PyTorch extensions that ship no wheel for today's torch, once per machine; cache them.

The adapters' optional test environments need native packages whose releases are source
only for current torch: the full mmcv (mmdet and mmseg import ``mmcv.ops``; they accept
only mmcv < 2.2) and PyG's ``torch_scatter`` / ``torch_sparse``. Each is compiled against
the shared torch of ``tools/torch_site.py`` in a throw-away virtual environment linked to
it, with CUDA hidden (CPU ops only), and the wheel is cached in

    <torch_site cache root>/wheels/<name>-<version>-for-<torch site name>/

keyed by the torch it was compiled against, written under an exclusive lock and moved into
place only when complete: concurrent callers wait for one build, and a killed build never
leaves a broken cache. Recipes (``RECIPES``):

* ``mmcv`` 2.1.0, about 15 min on 2 idle cores, with two fixes: ``setuptools < 70`` in the
  build environment (its setup.py imports ``pkg_resources``) and ``-std=c++20`` instead
  of the ``-std=c++17`` its setup.py asks for (today's ATen headers need C++20);
* ``torch-scatter`` 2.1.2 and ``torch-sparse`` 0.6.18 (pyg-lib has no source release on
  the package index, so it is not built).

All are compiled without debug information (``-g0``), which saves about a third of each
compile.

Commands::

    python tools/source_wheels.py install mmcv [torch-scatter ...]  # build if missing, pip install
    python tools/source_wheels.py ensure NAME ...   # build if missing, print the wheels' paths
    python tools/source_wheels.py path NAME ...     # print the cache directories (builds nothing)
    python tools/source_wheels.py adopt NAME WHEEL  # cache a wheel built elsewhere (same recipe)

``ACT_WHEEL_BUILD_JOBS`` sets the compile jobs (default: all CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_site

MARKER_NAME = ".act-source-wheel.json"


def _raise_cxx_standard(tree: Path) -> None:
    setup_py = tree / "setup.py"
    text = setup_py.read_text()
    patched = text.replace("'-std=c++17'", "'-std=c++20'")
    if patched == text:
        raise RuntimeError(f"{setup_py}: no '-std=c++17' to raise to C++20 (unexpected source)")
    setup_py.write_text(patched)


def _jobs() -> str:
    return os.environ.get("ACT_WHEEL_BUILD_JOBS") or str(os.cpu_count() or 2)


def _extensions_in_parallel(tree: Path) -> None:
    """Build a package's extension modules side by side (setuptools' ``build_ext -j``).

    torch-scatter and torch-sparse each build a dozen small extension modules, one after
    the other, and torch-scatter without ninja: a single compiler runs at a time however
    many cores there are."""
    with open(tree / "setup.cfg", "a") as cfg:
        cfg.write(f"\n[build_ext]\nparallel = {_jobs()}\n")


@dataclass(frozen=True)
class Recipe:
    name: str  # the distribution name on the package index
    version: str
    build_requirements: tuple[str, ...] = ("setuptools<80", "wheel", "ninja")
    env: dict[str, str] = field(default_factory=dict)
    patch: Callable[[Path], None] | None = None
    minutes: int = 10  # rough build time on 2 idle cores, for the log

    @property
    def wheel_stem(self) -> str:
        return self.name.replace("-", "_")


RECIPES = {
    r.name: r
    for r in (
        Recipe(
            "mmcv",
            "2.1.0",
            build_requirements=("setuptools<70", "wheel", "ninja"),
            env={"MMCV_WITH_OPS": "1"},
            patch=_raise_cxx_standard,
            minutes=15,
        ),
        Recipe("torch-scatter", "2.1.2", patch=_extensions_in_parallel, minutes=4),
        Recipe("torch-sparse", "0.6.18", patch=_extensions_in_parallel, minutes=6),
    )
}


def _log(msg: str) -> None:
    print(f"[source_wheels] {msg}", file=sys.stderr, flush=True)


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise SystemExit(f"unknown package {name!r}; recipes: {', '.join(RECIPES)}") from None


def wheel_dir(r: Recipe) -> Path:
    site = torch_site.site_dir().name
    return torch_site.cache_root() / "wheels" / f"{r.name}-{r.version}-for-{site}"


def find(r: Recipe) -> Path | None:
    """The cached wheel, or None when there is no complete one."""
    target = wheel_dir(r)
    if not (target / MARKER_NAME).is_file():
        return None
    wheels = sorted(target.glob(f"{r.wheel_stem}-{r.version}-*.whl"))
    return wheels[0] if len(wheels) == 1 else None


def _run(cmd: list[str], log: Path | None = None, **kwargs) -> None:
    _log("$ " + " ".join(cmd))
    if log is None:
        subprocess.run(cmd, check=True, **kwargs)
        return
    with open(log, "ab") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        _log("build failed; last lines of " + str(log) + ":\n" + "\n".join(tail))
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def build(r: Recipe, work: Path) -> Path:
    """Build ``r``'s wheel in ``work`` (a scratch directory); return the wheel's path."""
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / torch_site.PTH_NAME).write_text(f"{torch_site.ensure()}\n")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "install", "-q", *r.build_requirements])
    src = work / "src"
    download = ["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
    _run([*pip, *download, f"{r.name}=={r.version}", "-d", str(src)])
    (sdist,) = src.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(src, filter="data")
    (tree,) = (p for p in src.iterdir() if p.is_dir())
    if r.patch is not None:
        r.patch(tree)
    env = dict(os.environ)
    env.update(
        FORCE_CUDA="0",
        CUDA_VISIBLE_DEVICES="",  # CPU ops only, even on a machine with a GPU
        # No debug info: Python's own CFLAGS carry -g, which over torch's headers costs a
        # third of each compile (one file each: mmcv's nms.cpp 21.6 s -> 12.5 s, torch-
        # scatter's scatter.cpp 70.7 s -> 48.1 s) for symbols that the tests never read. The
        # optimisation level stays the packages' own. distutils appends CFLAGS after
        # Python's, so -g0 wins.
        CFLAGS=f"{os.environ.get('CFLAGS', '')} -g0".strip(),
        MAX_JOBS=_jobs(),
        **r.env,
    )
    dist = work / "dist"
    log = work / "build.log"
    _log(f"compiling {r.name} {r.version} for CPU (about {r.minutes} min on 2 idle cores)")
    _run(
        [*pip, "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", str(dist), str(tree)],
        log=log,
        env=env,
    )
    (wheel,) = dist.glob(f"{r.wheel_stem}-{r.version}-*.whl")
    return wheel


def _store(r: Recipe, wheel: Path, staged: Path, info: dict) -> None:
    """Put ``wheel`` and the marker into the fresh directory ``staged``, then publish it."""
    staged.mkdir()
    shutil.copy2(wheel, staged / wheel.name)
    marker = {"package": r.name, "version": r.version, "torch_site": str(torch_site.site_dir())}
    (staged / MARKER_NAME).write_text(json.dumps({**marker, **info}, indent=2) + "\n")
    target = wheel_dir(r)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staged, target)  # atomic: the directory appears complete or not at all


def ensure(r: Recipe) -> Path:
    """The cached wheel's path, building it first if needed."""
    found = find(r)
    if found is not None:
        return found
    target = wheel_dir(r)
    target.parent.mkdir(parents=True, exist_ok=True)
    with torch_site._locked(target.with_name(target.name + ".lock")):
        found = find(r)
        if found is not None:  # another process built it while we waited
            return found
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=target.name + ".tmp-", dir=target.parent) as tmp:
            wheel = build(r, Path(tmp))
            _store(
                r, wheel, Path(tmp) / "staged", {"build_seconds": round(time.monotonic() - start)}
            )
        _log(f"built {target} in {time.monotonic() - start:.0f} s")
    result = find(r)
    assert result is not None
    return result


def adopt(r: Recipe, wheel: Path) -> Path:
    """Put a wheel built elsewhere (same recipe) into the cache; return its path."""
    target = wheel_dir(r)
    target.parent.mkdir(parents=True, exist_ok=True)
    with torch_site._locked(target.with_name(target.name + ".lock")):
        if find(r) is None:
            staged = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            shutil.rmtree(staged, ignore_errors=True)
            _store(r, wheel, staged, {"from": str(wheel)})
    result = find(r)
    assert result is not None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "ensure", "path", "adopt"])
    parser.add_argument("names", nargs="+", help=f"packages: {', '.join(RECIPES)}")
    args = parser.parse_args(argv)
    try:
        if args.command == "adopt":
            if len(args.names) != 2:
                parser.error("adopt takes a package name and a wheel file")
            print(adopt(recipe(args.names[0]), Path(args.names[1])))
            return 0
        recipes = [recipe(n) for n in args.names]
        if args.command == "path":
            for r in recipes:
                print(wheel_dir(r))
            return 0
        wheels = [ensure(r) for r in recipes]
        if args.command == "ensure":
            for w in wheels:
                print(w)
            return 0
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install"]
        _run([*pip, *map(str, wheels)])
    except subprocess.CalledProcessError as exc:
        _log(f"a step failed (exit {exc.returncode}); nothing was cached or installed")
        return exc.returncode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
