"""The ``actcore`` command line: ``demo``, ``bench ...`` and (when built) ``native ...``.

Each command group is added by a ``register(subparsers)`` function and sets ``func`` (and
optionally ``validate``) with ``set_defaults``; ``func(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "build_parser", "main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The full ``actcore`` argument parser."""
    from . import __version__
    from .bench import register, register_demo

    parser = argparse.ArgumentParser(
        prog="actcore",
        description="Activation-compressed training for PyTorch: demo and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"actcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_demo(sub)
    register(sub)
    _register_native(sub)
    return parser


def _register_native(sub: argparse._SubParsersAction) -> None:
    """Add ``native`` if this actcore has it (actcore.native.cli); skip it otherwise."""
    try:
        from .native.cli import register
    except ImportError as err:
        if err.name not in ("actcore.native", "actcore.native.cli"):
            print(f"actcore: the 'native' command is unavailable: {err}", file=sys.stderr)
        return
    register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2: usage error, 130: interrupted, 1: the
    `cli` extra is not installed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    validate = getattr(args, "validate", None)
    if validate is not None:
        from .bench.routes import RouteUnavailable

        try:
            validate(args)
        except (ValueError, RouteUnavailable) as err:
            getattr(args, "_parser", parser).error(str(err))  # exits 2
    from .bench.report import MissingExtra, check_outputs

    if getattr(args, "json", None) or getattr(args, "png", None):
        try:  # before the run: a bad path must not cost the results
            check_outputs(args)
        except (ValueError, MissingExtra) as err:
            getattr(args, "_parser", parser).error(str(err))  # exits 2
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        getattr(args, "_parser", parser).error(f"--threads must be >= 1, got {threads}")
    with _torch_threads(threads):
        try:
            return int(func(args) or 0)
        except MissingExtra as err:
            print(f"actcore: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` torch CPU threads (None: as they are), restored afterwards."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    sys.exit(main())
