#!/usr/bin/env python3
"""Build mmcv (with its compiled CPU ops) once per machine, cache the wheel, install it.

mmdet and mmsegmentation import ``mmcv.ops``, so act-mm's OpenMMLab tests need the full
mmcv, and mmdet 3.3 / mmseg 1.2 accept only mmcv < 2.2. No mmcv 2.1 wheel exists for
today's torch, so it is built from its source release, which takes two fixes:

* ``setuptools < 70`` in the build environment (mmcv's setup.py imports ``pkg_resources``);
* ``-std=c++20`` instead of the ``-std=c++17`` its setup.py asks for (today's ATen headers
  need C++20).

The build runs in a throw-away virtual environment linked to the shared torch of
``tools/torch_site.py`` (the extension is compiled against exactly that torch), with CUDA
hidden (CPU ops only), and takes about 20 minutes on 2 idle cores. The wheel is cached in

    <torch_site cache root>/wheels/mmcv-<version>-for-<torch site name>/

keyed by the shared torch it was compiled against, written under an exclusive lock and
moved into place only when complete, so concurrent callers wait for one build and a killed
build never leaves a broken cache.

Commands (default: ``install``)::

    python tools/mmcv_wheel.py install   # build if missing, pip install it into this env
    python tools/mmcv_wheel.py ensure    # build if missing, print the wheel's path
    python tools/mmcv_wheel.py path      # print the cache directory (builds nothing)

``ACT_MMCV_BUILD_JOBS`` sets the compile jobs (default: all CPUs).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_site

MMCV_VERSION = "2.1.0"
BUILD_REQUIREMENTS = ["setuptools<70", "wheel", "ninja"]
MARKER_NAME = ".act-mmcv-wheel.json"


def _log(msg: str) -> None:
    print(f"[mmcv_wheel] {msg}", file=sys.stderr, flush=True)


def wheel_dir() -> Path:
    return (
        torch_site.cache_root() / "wheels" / f"mmcv-{MMCV_VERSION}-for-{torch_site.site_dir().name}"
    )


def find() -> Path | None:
    """The cached wheel, or None when there is no complete one."""
    target = wheel_dir()
    if not (target / MARKER_NAME).is_file():
        return None
    wheels = sorted(target.glob(f"mmcv-{MMCV_VERSION}-*.whl"))
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


def _patch_setup(setup_py: Path) -> None:
    text = setup_py.read_text()
    patched = text.replace("'-std=c++17'", "'-std=c++20'")
    if patched == text:
        raise RuntimeError(f"{setup_py}: no '-std=c++17' to raise to C++20 (unexpected mmcv)")
    setup_py.write_text(patched)


def build(work: Path) -> Path:
    """Build the mmcv wheel in ``work`` (a scratch directory); return the wheel's path."""
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
    _run([*pip, "install", "-q", *BUILD_REQUIREMENTS])
    src = work / "src"
    download = ["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
    _run([*pip, *download, f"mmcv=={MMCV_VERSION}", "-d", str(src)])
    (sdist,) = src.glob(f"mmcv-{MMCV_VERSION}.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(src, filter="data")
    tree = src / f"mmcv-{MMCV_VERSION}"
    _patch_setup(tree / "setup.py")
    env = dict(os.environ)
    env.update(
        MMCV_WITH_OPS="1",
        FORCE_CUDA="0",
        CUDA_VISIBLE_DEVICES="",  # CPU ops only, even on a machine with a GPU
        MAX_JOBS=os.environ.get("ACT_MMCV_BUILD_JOBS") or str(os.cpu_count() or 2),
    )
    dist = work / "dist"
    log = work / "build.log"
    _log(f"compiling mmcv {MMCV_VERSION} ops for CPU (about 20 min on 2 idle cores); log: {log}")
    _run(
        [*pip, "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", str(dist), str(tree)],
        log=log,
        env=env,
    )
    (wheel,) = dist.glob(f"mmcv-{MMCV_VERSION}-*.whl")
    return wheel


def ensure() -> Path:
    """The cached wheel's path, building it first if needed."""
    found = find()
    if found is not None:
        return found
    target = wheel_dir()
    with torch_site._locked(target.with_name(target.name + ".lock")):
        found = find()
        if found is not None:  # another process built it while we waited
            return found
        if target.exists():
            _log(f"removing incomplete {target}")
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=target.name + ".tmp-", dir=target.parent) as tmp:
            wheel = build(Path(tmp))
            staged = Path(tmp) / "staged"
            staged.mkdir()
            shutil.copy2(wheel, staged / wheel.name)
            marker = {
                "mmcv": MMCV_VERSION,
                "torch_site": str(torch_site.site_dir()),
                "build_seconds": round(time.monotonic() - start),
            }
            (staged / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            os.rename(staged, target)  # atomic: the dir appears complete or not at all
        _log(f"built {target} in {time.monotonic() - start:.0f} s")
    result = find()
    assert result is not None
    return result


def adopt(wheel: Path) -> Path:
    """Put an mmcv wheel built elsewhere (same recipe) into the cache; return its path."""
    target = wheel_dir()
    with torch_site._locked(target.with_name(target.name + ".lock")):
        if find() is not None:
            return find()  # type: ignore[return-value]
        staged = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        shutil.copy2(wheel, staged / wheel.name)
        marker = {
            "mmcv": MMCV_VERSION,
            "torch_site": str(torch_site.site_dir()),
            "from": str(wheel),
        }
        (staged / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staged, target)
    return find()  # type: ignore[return-value]


def install() -> Path:
    wheel = ensure()
    _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", str(wheel)])
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", nargs="?", default="install", choices=["install", "ensure", "path", "adopt"]
    )
    parser.add_argument("wheel", nargs="?", help="for adopt: the wheel file to cache")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            install()
        elif args.command == "ensure":
            print(ensure())
        elif args.command == "path":
            print(wheel_dir())
        else:
            if not args.wheel:
                parser.error("adopt needs the wheel's path")
            print(adopt(Path(args.wheel)))
    except subprocess.CalledProcessError as exc:
        _log(f"a step failed (exit {exc.returncode}); nothing was cached or installed")
        return exc.returncode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
