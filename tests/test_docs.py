"""The docs' code: every ``python`` block of README.md, docs/*.md and actcore's own package
README runs as it is (each in a fresh interpreter, in a scratch directory), and the README
stays short and starts with its two commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "packages" / "actcore" / "README.md",
]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for i, code in enumerate(BLOCK.findall(doc.read_text())):
            found.append((f"{doc.relative_to(ROOT)}#{i}", code))
    return found


def test_the_docs_have_code_to_run() -> None:
    names = [name for name, _ in _blocks()]
    assert any(n.startswith("README.md") for n in names)
    assert any(n.startswith("docs/GUIDE.md") for n in names)
    assert any(n.startswith("packages/actcore/README.md") for n in names)


@pytest.mark.parametrize("name,code", _blocks(), ids=[n for n, _ in _blocks()])
def test_a_python_block_runs(name: str, code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_the_readme_is_short_and_starts_with_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    first = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first is not None
    demo, test = first.group(1).splitlines()[:2]
    assert demo.startswith("make demo") and test.startswith("make test")
