"""The float32 quantize kernel's division-free quotient against a true division.

The CUDA kernel replaces ``(x - lo) / step`` by a reciprocal, a product and one FMA residual
(Markstein's theorem; ``csrc/README.md``). It cannot run here, so the same arithmetic runs in
C on the host (IEEE float32, ``fmaf`` correctly rounded, no contraction) on random operands
from the kernel's range, including operands next to a multiple of the step where codes flip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "c" / "division_free_quotient.c"


@pytest.mark.parametrize("seed", [1, 2])
def test_division_free_quotient_matches_the_division(tmp_path: Path, seed: int) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "check"
    flags = ["-O2", "-std=c99", "-ffp-contract=off", "-fno-fast-math"]
    subprocess.run([cc, *flags, str(SOURCE), "-o", str(exe), "-lm"], check=True)
    done = subprocess.run([str(exe), "3000000", str(seed)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    assert "0 quotients and 0 codes differ" in done.stdout
