#!/usr/bin/env python3
"""Share one installed torch (and torchvision) between all development environments.

torch is several GB; installing it into every tox env and into ``.venv`` would cost
minutes and gigabytes per environment. Instead this script installs it once, with
``pip install --target``, into a shared directory outside the repository:

    ${ACT_TORCH_CACHE:-${XDG_CACHE_HOME:-~/.cache}/act-dev}/torch-site-<torch>-<tv>-py<XY>-<platform>

and links an environment to it by writing one ``.pth`` file (``act_torch_site.pth``)
into that environment's site-packages. Python appends a ``.pth`` entry to ``sys.path``
*after* the environment's own site-packages, so:

* ``import torch`` and pip both see the shared torch (pip does not reinstall it when a
  package requires ``torch``);
* anything the environment installs itself shadows the shared copy;
* pip never modifies or uninstalls the shared copy (it lies outside the environment);
* each environment's other dependencies stay in its own site-packages, so one adapter's
  frameworks never leak into another adapter's environment.

The shared directory holds only torch, torchvision and their own dependencies. It is
built in a temporary sibling directory and renamed into place when complete, under an
exclusive lock, so concurrent callers wait for one install and a killed install never
leaves a half-written cache.

Commands (default: ``link``)::

    python tools/torch_site.py link     # install if missing, link the running interpreter's env
    python tools/torch_site.py ensure   # install if missing, print the directory
    python tools/torch_site.py path     # print the directory (installs nothing)
    python tools/torch_site.py check    # fail unless torch/torchvision come from the shared dir
    python tools/torch_site.py unlink   # remove the .pth from the running interpreter's env

Environment variables:

* ``ACT_TORCH_SPEC`` (default ``torch==2.14.1``) and ``ACT_TORCHVISION_SPEC`` (default
  ``torchvision==0.29.1``): pip requirement strings; each distinct pair gets its own dir.
* ``ACT_TORCH_CACHE``: the parent directory of the shared dirs.
* ``ACT_TORCH_PIP_ARGS``: extra arguments for the one ``pip install`` (e.g. an index URL
  for CPU-only wheels), split like a shell would.

POSIX only (it uses ``fcntl`` for the lock).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULT_TORCH_SPEC = "torch==2.14.1"
DEFAULT_TORCHVISION_SPEC = "torchvision==0.29.1"
PTH_NAME = "act_torch_site.pth"
MARKER_NAME = ".act-torch-site.json"


def _specs() -> tuple[str, str]:
    torch_spec = os.environ.get("ACT_TORCH_SPEC", "").strip() or DEFAULT_TORCH_SPEC
    tv_spec = os.environ.get("ACT_TORCHVISION_SPEC", "").strip() or DEFAULT_TORCHVISION_SPEC
    return torch_spec, tv_spec


def _slug(spec: str, name: str) -> str:
    """``torch==2.14.1`` -> ``2.14.1``; ``torch>=2.4,<3`` -> ``ge2.4_lt3``."""
    rest = spec.strip()
    if rest.lower().startswith(name):
        rest = rest[len(name) :]
    for op, word in (("===", "eq"), ("==", ""), (">=", "ge"), ("<=", "le"), ("~=", "compat")):
        rest = rest.replace(op, word)
    rest = rest.replace(">", "gt").replace("<", "lt").replace("!=", "ne")
    rest = re.sub(r"[^A-Za-z0-9.+]+", "_", rest).strip("_")
    return rest or "any"


def cache_root() -> Path:
    explicit = os.environ.get("ACT_TORCH_CACHE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(xdg).expanduser() / "act-dev").resolve()


def site_dir() -> Path:
    torch_spec, tv_spec = _specs()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    plat = f"{sys.platform}-{platform.machine().lower() or 'unknown'}"
    name = f"torch-site-{_slug(torch_spec, 'torch')}-{_slug(tv_spec, 'torchvision')}-{py}-{plat}"
    return cache_root() / name


def _log(msg: str) -> None:
    print(f"[torch_site] {msg}", file=sys.stderr, flush=True)


@contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process holding {lock_path} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(target: Path) -> bool:
    return (target / MARKER_NAME).is_file() and (target / "torch" / "__init__.py").is_file()


def ensure() -> Path:
    """Return the shared dir, installing torch and torchvision into it first if needed."""
    target = site_dir()
    if _is_complete(target):
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process finished it while we waited
            return target
        # We hold the lock: any leftover temp dir or partial target is from a dead install.
        for stale in target.parent.glob(target.name + ".tmp-*"):
            _log(f"removing leftover {stale}")
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            _log(f"removing incomplete {target}")
            shutil.rmtree(target)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        torch_spec, tv_spec = _specs()
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--target",
            str(tmp),
            *shlex.split(os.environ.get("ACT_TORCH_PIP_ARGS", "")),
            torch_spec,
            tv_spec,
        ]
        _log(f"installing {torch_spec} {tv_spec} once into {target} (this takes a while)")
        _log("$ " + shlex.join(cmd))
        start = time.monotonic()
        try:
            subprocess.run(cmd, check=True)
            if not (tmp / "torch" / "__init__.py").is_file():
                raise RuntimeError(f"pip finished but {tmp / 'torch'} is missing")
            versions = {}
            for dist in importlib.metadata.distributions(path=[str(tmp)]):
                versions[dist.metadata["Name"]] = dist.version
            marker = {
                "torch_spec": torch_spec,
                "torchvision_spec": tv_spec,
                "python": sys.version.split()[0],
                "installed": dict(sorted(versions.items(), key=lambda kv: kv[0].lower())),
            }
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            os.rename(tmp, target)  # atomic: the dir appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _log(f"installed in {time.monotonic() - start:.0f} s")
    return target


def _env_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _in_virtualenv() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix)


def link(force: bool = False) -> Path:
    if not _in_virtualenv() and not force:
        raise SystemExit(
            f"[torch_site] refusing to link {sys.executable}: it is not a virtual environment "
            "(pass --force to link it anyway)"
        )
    target = ensure()
    pth = _env_site_packages() / PTH_NAME
    content = f"{target}\n"
    if not pth.is_file() or pth.read_text() != content:
        pth.parent.mkdir(parents=True, exist_ok=True)
        tmp = pth.with_name(pth.name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, pth)
        _log(f"linked {sys.prefix} -> {target}")
    else:
        _log(f"{sys.prefix} already linked to {target}")
    return target


def unlink() -> None:
    pth = _env_site_packages() / PTH_NAME
    if pth.exists():
        pth.unlink()
        _log(f"removed {pth}")


def _dist_location(name: str) -> Path | None:
    """Where ``name`` would be imported from in a fresh interpreter of this env."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(dist.locate_file("")).resolve()


def check() -> None:
    """Fail unless this env gets torch and torchvision from the shared dir.

    Catches the silent failure mode of the whole scheme: a requirement the shared torch
    does not satisfy makes pip install a second torch into the env itself.
    """
    target = site_dir().resolve()
    pth = _env_site_packages() / PTH_NAME
    problems = []
    if not pth.is_file():
        problems.append(f"{pth} is missing (run: python tools/torch_site.py link)")
    for name in ("torch", "torchvision"):
        where = _dist_location(name)
        if where is None:
            problems.append(f"{name} is not installed")
        elif where != target:
            problems.append(
                f"{name} comes from {where}, not the shared {target}: something in this "
                "env required a torch the shared one does not satisfy, so pip installed "
                "another copy here"
            )
    if problems:
        raise SystemExit("[torch_site] check failed:\n  " + "\n  ".join(problems))
    _log(
        f"ok: torch {importlib.metadata.version('torch')} and torchvision "
        f"{importlib.metadata.version('torchvision')} from {target}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        nargs="?",
        default="link",
        choices=["link", "ensure", "path", "check", "unlink"],
    )
    parser.add_argument(
        "--force", action="store_true", help="link even outside a virtual environment"
    )
    args = parser.parse_args(argv)
    try:
        _run(args)
    except subprocess.CalledProcessError as exc:
        _log(f"pip failed (exit {exc.returncode}); nothing was installed or linked")
        return exc.returncode or 1
    return 0


def _run(args: argparse.Namespace) -> None:
    if args.command == "link":
        link(force=args.force)
    elif args.command == "ensure":
        print(ensure())
    elif args.command == "path":
        print(site_dir())
    elif args.command == "check":
        check()
    elif args.command == "unlink":
        unlink()


if __name__ == "__main__":
    sys.exit(main())
