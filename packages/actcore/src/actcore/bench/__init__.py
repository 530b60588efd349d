"""``actcore bench``: the memory, speed, max-batch, accuracy, training and kernel benchmarks.

Each subcommand lives in its own module with ``register(subparsers, common)``; ``bench``
with no subcommand runs the demo (:mod:`actcore.bench.demo`).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_common", "register", "register_demo"]


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every benchmark takes: ``--json FILE``, ``--quiet`` and ``--threads N``."""
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's own choice, except 1 for demo and accuracy)",
    )
    p.set_defaults(_parser=p)


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands to the ``actcore`` command line."""
    from . import accuracy, demo, kernels, maxbatch, memory, plan, sweep, train, zoo

    p = subparsers.add_parser(
        "bench",
        help=(
            "benchmarks: memory, zoo, accuracy, train, max-batch, sweep, kernels, plan "
            "(alone: the demo)"
        ),
        description=(
            "Benchmarks of activation-compressed training. Without a subcommand: the demo "
            "(memory saved on a ResNet-50 and accuracy kept on digits, a few minutes on a CPU)."
        ),
    )
    demo.add_arguments(p, add_common)
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for module in (memory, zoo, accuracy, train, maxbatch, sweep, kernels, plan):
        module.register(sub, add_common)


def register_demo(subparsers: Any) -> None:
    """Add ``demo`` (the same as ``bench`` with no subcommand)."""
    from . import demo

    p = subparsers.add_parser(
        "demo",
        help="memory saved per level on a ResNet-50 and accuracy kept on digits (minutes on a CPU)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(p, add_common)
