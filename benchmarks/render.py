"""Print the Markdown section of one committed benchmark result (for BENCHMARKS.md).

    python benchmarks/render.py benchmarks/results/cpu-resnet50-memory.json

Tables use the same columns and formatting as ``actcore bench`` in the terminal; the header
lists the machine, date, torch version and the command that reproduces the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from actcore.bench import accuracy, maxbatch, memory, report, sweep, train


def header(data: dict) -> str:
    m = data["machine"]
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    mem = f", {m['memory_bytes'] / 2**30:.0f} GiB RAM" if m.get("memory_bytes") else ""
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores{mem}{gpu}; torch threads "
        f"{m.get('torch_threads')}",
        f"- date: {data['date']}; torch {data['torch']}; Python {m.get('python')}",
        f"- command: `{data['command']}`",
    ]
    if data.get("partial"):
        lines.append("- partial: interrupted before the end")
    return "\n".join(lines)


def section(data: dict) -> str:
    kind = data["benchmark"]
    rows = data["rows"]
    if kind == "memory":
        cuda = any(r.get("gpu_peak_bytes") for r in rows)
        table = report.markdown(memory.columns(cuda, any("error" in r for r in rows)), rows)
    elif kind == "accuracy":
        table = report.markdown(accuracy.COLUMNS, rows)
    elif kind == "demo":
        mem_rows = [r for r in rows if r["benchmark"] == "memory"]
        acc_rows = [r for r in rows if r["benchmark"] == "accuracy"]
        table = (
            report.markdown(memory.columns(False), mem_rows)
            + "\n\n"
            + report.markdown(accuracy.COLUMNS, acc_rows)
        )
    elif kind == "sweep":
        table = report.markdown(sweep.COLUMNS, rows)
    elif kind == "train":
        table = report.markdown(train.columns(data["config"]["task"], rows), rows)
        png = data["config"].get("png")
        if png:
            table += f"\n\n![curves](results/{Path(png).name})"
    elif kind == "max-batch":
        table = report.markdown(maxbatch.COLUMNS, rows)
    else:
        table = "```json\n" + json.dumps(rows, indent=1) + "\n```"
    return header(data) + "\n\n" + table + "\n"


def main(paths: list[str]) -> int:
    for path in paths:
        print(section(json.loads(Path(path).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
