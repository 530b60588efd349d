"""``actcore native``: build the CUDA kernels ahead of time, check they compile, or inspect.

``actcore/cli.py`` calls :func:`register` on its subparsers; ``python -m actcore.native``
runs the same commands standalone (:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "register", "run_build", "run_status"]


def register(subparsers: Any) -> None:
    """Add the ``native`` command (``build``, ``status``) to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "native",
        help="build or inspect actcore's CUDA kernels",
        description="Build actcore's CUDA kernels (csrc/) ahead of time, check that they "
        "compile (no GPU needed), or show what is loaded.",
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``build`` and ``status`` subcommands, on ``parser``."""
    commands = parser.add_subparsers(dest="native_command", metavar="{build,status}")
    commands.required = True
    build = commands.add_parser(
        "build",
        help="compile the CUDA kernels (cached under ~/.cache/actcore/native)",
        description="Compile and link the CUDA kernels with ninja; a cached build is reused. "
        "The library is registered against the op schemas (no kernel runs, no GPU needed).",
    )
    build.add_argument(
        "--check",
        action="store_true",
        help="only check that the kernels compile, for --arch (default 9.0); exit non-zero "
        "on a compile error",
    )
    build.add_argument(
        "--arch",
        default=None,
        help="CUDA architectures, e.g. 9.0 or '8.0;9.0+PTX' (default: 9.0 with --check, "
        "else $TORCH_CUDA_ARCH_LIST, the visible GPUs', or 9.0)",
    )
    build.add_argument(
        "--build-dir", type=Path, default=None, help="build here instead of the cache"
    )
    build.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    build.set_defaults(func=run_build)
    status = commands.add_parser("status", help="what is loaded, the toolkit, the build dir")
    status.add_argument(
        "--load", action="store_true", help="try to load the kernels first (builds if needed)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=run_status)


def run_build(args: argparse.Namespace) -> int:
    """``actcore native build [--check] [--arch A]``; 0 on success, 1 on any failure."""
    from . import build, loader

    arch = args.arch if args.arch is not None else (build.DEFAULT_ARCH if args.check else None)
    try:
        plan = build.plan_build(arch=arch, build_dir=args.build_dir)
        print(
            f"building {build.EXTENSION_NAME} for {', '.join(map(build.arch_label, plan.arches))} "
            f"with nvcc {plan.toolkit.version} ({plan.toolkit.root}, found by "
            f"{plan.toolkit.found_by})\n  in {plan.build_dir}",
            flush=True,
        )
        path, seconds = build.timed_build(plan, verbose=args.verbose)
        loader.register(path)
    except build.NativeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    what = "compile check passed" if args.check else "built"
    print(f"{what} in {seconds:.1f} s: {path} (its kernels register against the op schemas)")
    return 0


def run_status(args: argparse.Namespace) -> int:
    """``actcore native status``: always 0 (it reports problems, it does not fail on them)."""
    from . import loader
    from .build import arch_label

    if args.load:
        loader.load(warn=False)
        loader.load_cpu(warn=False)
    info = loader.status()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["loaded"]:
        loaded = f"yes, {info['library']}"
        if not info["devices"]:
            loaded += " (registered; no CUDA device to run them on)"
    elif info["attempted"]:
        loaded = f"no: {info['error']}"
    else:
        loaded = "no (they load on the first op on a CUDA tensor; --load tries now)"
    toolkit = info["toolkit"]
    rows = [
        ("kernels loaded", loaded),
        ("devices", ", ".join(info["devices"]) or "no CUDA device"),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda']})"),
        (
            "CUDA toolkit",
            f"{toolkit['root']} (nvcc {toolkit['nvcc']}, found by {toolkit['found_by']})"
            if toolkit
            else f"not found: {info.get('toolkit_error')}",
        ),
        ("sources", info["sources"] or info.get("sources_error")),
        (
            "build dir",
            f"{info['build_dir']} ({'built' if info['built'] else 'not built yet'}, "
            f"{', '.join(map(arch_label, info['arches']))})"
            if info["build_dir"]
            else f"none: {info.get('plan_error')}",
        ),
        ("ACTCORE_NATIVE", "off" if info["disabled"] else "on"),
        ("CPU kernels", _cpu_row(info["cpu"])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _cpu_row(cpu: dict[str, Any]) -> str:
    """One line on the CPU kernels (csrc/cpu_kernels.cpp)."""
    if cpu["active"]:
        isa = {"avx2": "AVX2", "avx512": "AVX-512"}.get(cpu["isa"], "baseline ISA")
        threads = cpu.get("threads")
        on = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
        return f"active ({isa}{on}), {cpu['library']}"
    if cpu["attempted"]:
        return f"not active: {cpu['error'] or 'switched off in this process'}"
    if cpu["disabled"]:
        return "off (ACTCORE_NATIVE_CPU / ACTCORE_NATIVE)"
    built = "built" if cpu["built"] else "not built yet"
    return f"not loaded ({built}, {cpu['build_dir']}; they load on the first op on a CPU tensor)"


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m actcore.native {build,status} ...``."""
    parser = argparse.ArgumentParser(prog="actcore native", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))
