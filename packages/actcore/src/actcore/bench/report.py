"""Results of a benchmark: the machine they came from, terminal tables, JSON, progress bars.

Every JSON result is ``{"benchmark", "machine", "torch", "date", "command", "config",
"partial", "rows": [...]}``. :func:`run_guarded` runs a benchmark so that Ctrl-C keeps what
was measured so far (table and JSON, ``"partial": true``) and exits 130;
:func:`run_with_progress` does so under a progress bar, as the benchmarks' ``main`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import importlib
import json
import math
import os
import platform
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

__all__ = [
    "CLI_EXTRA",
    "EXIT_INTERRUPTED",
    "OUTPUT_OPTIONS",
    "Column",
    "MissingExtra",
    "atomic_path",
    "check_output_path",
    "check_outputs",
    "command_line",
    "config_from_args",
    "console",
    "cpu_model",
    "fmt_bytes",
    "fmt_float",
    "machine_info",
    "markdown",
    "optional_import",
    "progress",
    "result",
    "run_guarded",
    "run_with_progress",
    "table",
    "write_json",
]

EXIT_INTERRUPTED = 130
_Config = TypeVar("_Config")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform reports."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, GPU (when CUDA is available), OS and Python of this machine."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": None,
        "gpu_memory_bytes": None,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
    return info


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that reproduces a run, as typed (``actcore bench ...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["actcore", *args])


def result(
    benchmark: str,
    rows: list[dict[str, Any]],
    config: dict[str, Any],
    *,
    partial: bool = False,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The JSON envelope of a benchmark's rows."""
    return {
        "benchmark": benchmark,
        "machine": machine_info(),
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "config": config,
        "partial": partial,
        "rows": rows,
    }


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become null, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def config_from_args(cls: type[_Config], args: argparse.Namespace) -> _Config:
    """A benchmark's config dataclass, every field read from the parsed argument of its name."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def check_output_path(path: str | os.PathLike[str], option: str) -> Path:
    """``path`` if a file can be written there (parents created), else ValueError naming it.

    Run before a benchmark, so a bad ``--json``/``--png`` is found before the work, not after.
    Creates and removes a probe file in the target directory; an existing file is untouched.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a directory; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"{option} {str(path)!r} cannot be written: {err.strerror or err}"
        ) from None
    return path


def _mode_for(path: Path) -> int:
    """The permissions ``path`` has, or those ``open`` would give a new file (the umask's)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` on success and
    removed on any error, so neither a half-written file nor a stray temporary stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _mode_for(path))  # not mkstemp's 0600: the file's own, or open()'s
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write ``data`` to ``path`` (parents created), atomically: never a half-written file."""
    path = Path(path)
    text = json.dumps(_clean(data), indent=2) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


OUTPUT_OPTIONS = (("json", "--json"), ("png", "--png"))


def check_outputs(args: argparse.Namespace) -> None:
    """Check every output path option of a parsed command line (``--json``, ``--png``), and
    that matplotlib is there for ``--png`` (else :class:`MissingExtra`)."""
    for attr, option in OUTPUT_OPTIONS:
        value = getattr(args, attr, None)
        if value:
            check_output_path(value, option)
    if getattr(args, "png", None):
        optional_import("matplotlib.figure")


# --------------------------------------------------------------------------------------------
# Optional dependencies (the ``cli`` extra)
# --------------------------------------------------------------------------------------------

CLI_EXTRA = "actcore[cli]"
"""The extra that installs what the command line and the benchmarks use (rich, matplotlib)."""


class MissingExtra(ImportError):
    """A module of the ``cli`` extra is not installed."""


def optional_import(module: str) -> ModuleType:
    """``module`` imported, else :class:`MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.partition(".")[0]
        raise MissingExtra(
            f"{top} is not installed; the actcore command line and benchmarks need it: "
            f"pip install '{CLI_EXTRA}'",
            name=top,
        ) from err


# --------------------------------------------------------------------------------------------
# Terminal output
# --------------------------------------------------------------------------------------------


def console(stderr: bool = False) -> Any:
    """A rich console on stdout (or stderr), created now so redirections are honoured."""
    Console = optional_import("rich.console").Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120
    return Console(file=stream, width=width, highlight=False)


@dataclass(frozen=True)
class Column:
    """A table column: the row key, its header and how to format the value."""

    key: str
    header: str
    fmt: Callable[[Any], str] = str
    justify: str = "right"


def fmt_bytes(n: int | None) -> str:
    from ..memory import format_bytes

    return "-" if n is None else format_bytes(int(n))


def fmt_float(digits: int, suffix: str = "") -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.{digits}f}{suffix}"

    return fmt


def table(title: str, columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> Any:
    """A rich ``Table`` of ``rows`` (missing keys shown as '-')."""
    Table = optional_import("rich.table").Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col.header, justify=col.justify)  # type: ignore[arg-type]
    for row in rows:
        t.add_row(
            *(col.fmt(row[col.key]) if row.get(col.key) is not None else "-" for col in columns)
        )
    return t


def markdown(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """``rows`` as a Markdown table (for BENCHMARKS.md), formatted as in the terminal."""
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join(":---" if c.justify == "left" else "---:" for c in columns) + "|",
    ]
    for row in rows:
        cells = (c.fmt(row[c.key]) if row.get(c.key) is not None else "-" for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr; yields ``advance(n=1, description=None)``."""
    if not enabled:
        yield lambda n=1, description=None: None
        return
    rp = optional_import("rich.progress")

    bar = rp.Progress(
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.TextColumn("{task.completed}/{task.total}"),
        rp.TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None) -> None:
            if description is not None:
                bar.update(task, description=description)
            bar.advance(task, n)

        yield advance


def run_guarded(
    benchmark: str,
    runner: Callable[[list[dict[str, Any]]], None],
    *,
    config: dict[str, Any],
    json_path: str | None,
    show: Callable[[list[dict[str, Any]]], None],
    argv: Sequence[str] | None = None,
) -> int:
    """Run ``runner(rows)``, which appends rows as it goes; show and save them.

    On Ctrl-C the rows collected so far are shown and written (``"partial": true``) and the
    exit code is 130; otherwise 0.
    """
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        runner(rows)
    except KeyboardInterrupt:
        interrupted = True
    show(rows)
    if json_path:
        data = result(benchmark, rows, config, partial=interrupted, argv=argv)
        path = write_json(json_path, data)
        note = " (partial)" if interrupted else ""
        console(stderr=True).print(f"wrote {path}{note}")
    if interrupted:
        console(stderr=True).print(
            f"interrupted: kept {len(rows)} row(s)"
            + ("" if json_path else "; pass --json FILE to save them")
        )
        return EXIT_INTERRUPTED
    return 0


def run_with_progress(
    benchmark: str,
    args: argparse.Namespace,
    total: int,
    run: Callable[[list[dict[str, Any]], Callable[..., None]], None],
    *,
    config: dict[str, Any],
    show: Callable[[list[dict[str, Any]]], None],
) -> int:
    """:func:`run_guarded` of ``run(rows, advance)`` under a :func:`progress` bar of ``total``
    steps (none with ``--quiet``), the rows written to ``--json`` when given."""

    def runner(rows: list[dict[str, Any]]) -> None:
        with progress(total, benchmark, enabled=not args.quiet) as advance:
            run(rows, advance)

    return run_guarded(benchmark, runner, config=config, json_path=args.json, show=show)
