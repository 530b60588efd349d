"""Tests of actcore.fewbit's tables: the optimal piecewise-constant fit, its error by
quadrature, parity folding, the shipped data file and the table command."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import integrate, special

import actcore.fewbit as fb
from actcore.fewbit import tables as fb_tables
from actcore.fewbit.derivatives import DERIVATIVES
from actcore.fewbit.optimal import fit_piecewise_constant, uniform

# --------------------------------------------------------------------------------------------
# Tables: optimality, independent error check, parity, reproducibility
# --------------------------------------------------------------------------------------------


def _quad_error(g, borders, pdf, lo, hi) -> tuple[float, list[float]]:
    """E[(g - c)^2] with optimal (conditional-mean) levels, by scipy quadrature."""
    edges = [lo, *borders, hi]
    total, levels = 0.0, []
    for a, b in itertools.pairwise(edges):
        m0 = integrate.quad(pdf, a, b, limit=200)[0]
        m1 = integrate.quad(lambda t: g(t) * pdf(t), a, b, limit=200)[0]
        m2 = integrate.quad(lambda t: g(t) ** 2 * pdf(t), a, b, limit=200)[0]
        levels.append(m1 / m0)
        total += m2 - m1 * m1 / m0
    return total, levels


def test_dynamic_programme_is_exact_against_brute_force() -> None:
    g = lambda t: np.sin(3.0 * t) + (t > 0.2)  # noqa: E731 - non-monotone with a jump
    dist = uniform(-1.0, 1.0)
    fits = fit_piecewise_constant(g, dist, (3,), cells=10)
    interior = np.linspace(-1.0, 1.0, 11)[1:-1]
    best = min(
        (_quad_error(g, b, lambda t: 0.5, -1.0, 1.0)[0], b)
        for b in itertools.combinations(interior, 2)
    )
    assert fits[3].error == pytest.approx(best[0], rel=1e-9, abs=1e-12)
    assert np.allclose(fits[3].borders, best[1])


def normal_pdf(t: float) -> float:
    return math.exp(-t * t / 2) / math.sqrt(2 * math.pi)


def gelu_grad(t: float) -> float:
    return special.ndtr(t) + t * normal_pdf(t)


def test_table_error_and_levels_checked_by_quadrature_on_the_whole_line() -> None:
    """Independent of the library's grid, quadrature and truncation: scipy over all of R."""
    table = fb.get_table("gelu", 3)
    error, levels = _quad_error(gelu_grad, table.borders, normal_pdf, -np.inf, np.inf)
    assert table.l2_error == pytest.approx(error, rel=1e-7)
    assert np.allclose(table.levels, levels, rtol=1e-7, atol=1e-9)
    # local optimality: moving any border (re-fitting the levels) never helps
    for i, shift in itertools.product(range(len(table.borders)), (-0.03, 0.03)):
        moved = list(table.borders)
        moved[i] += shift
        if sorted(moved) == moved:
            assert _quad_error(gelu_grad, moved, normal_pdf, -np.inf, np.inf)[0] > error


def test_parity_folding_beats_a_full_line_table() -> None:
    """tanh' is even: tabling |x| gives 2**(bits+1) symmetric intervals for the same bits."""
    full = fit_piecewise_constant(
        DERIVATIVES["tanh"].bind({}), fb.NORMAL, (2, 4, 8, 16), cells=fb_tables.DEFAULT_CELLS
    )
    for bits in range(1, 5):
        folded = fb.get_table("tanh", bits)
        assert folded.folded
        ratio = folded.l2_error / full[2**bits].error
        print(f"tanh, {bits} bits: L2 error folded / full line = {ratio:.3f}")
        assert ratio < 0.8


@pytest.mark.parametrize("key", [("gelu", {}), ("tanh", {}), ("gelu", {"approximate": "tanh"})])
def test_shipped_tables_equal_fresh_computation(key) -> None:
    name, params = key
    fresh = fb.compute_tables(name, **params)
    shipped = fb_tables.shipped_tables()[fresh[1].key]
    for bits in range(1, 5):
        assert fb_tables.tables_match(fresh[bits], shipped[bits])
    assert set(fb_tables.shipped_tables()) == {*DERIVATIVES, "gelu(approximate='tanh')"}


def test_shipped_data_file_regenerates() -> None:
    """``tables.json`` is what the generator writes: every table recomputed (about 3 s)
    matches it to the last bits, and rendering the loaded tables gives the file back."""
    shipped = fb_tables.shipped_tables()
    fresh = [fb.compute_tables(name, **params) for name, params in fb_tables.SHIPPED_KEYS]
    assert [f[1].key for f in fresh] == list(shipped)
    for by_bits in fresh:
        for bits, table in by_bits.items():
            assert fb_tables.tables_match(table, shipped[table.key][bits], rtol=1e-12, atol=1e-15)
    path = Path(fb_tables.__file__).with_name("tables.json")
    assert fb_tables.render_data(shipped.values()) == path.read_text(encoding="utf-8")


def test_table_command_writes_checks_and_prints(tmp_path, capsys) -> None:
    out = tmp_path / "tables.json"
    assert fb_tables.main(["--write", str(out), "--activation", "sigmoid"]) == 0
    written = fb_tables.read_tables_file(out)
    assert list(written["TABLES"]) == ["sigmoid"]
    assert written["META"]["distribution"] == fb.NORMAL.name
    shipped = fb_tables.shipped_tables()["sigmoid"]
    for bits, entry in written["TABLES"]["sigmoid"]["bits"].items():
        # recomputed in this process: equal to the shipped table up to the last ulp
        assert entry["levels"] == pytest.approx(list(shipped[bits].levels), rel=1e-12, abs=1e-15)
        assert entry["borders"] == pytest.approx(list(shipped[bits].borders), rel=1e-12, abs=1e-15)
    assert fb_tables.main(["--check", "--activation", "softsign"]) == 0
    assert fb_tables.main([]) == 0
    printed = capsys.readouterr().out
    assert "gelu(approximate='tanh')" in printed and "1 activations match" in printed


def test_table_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="no derivative table for 'relu'"):
        fb.get_table("relu", 3)
    with pytest.raises(TypeError, match="alpha"):
        fb.get_table("gelu", 3, alpha=1.0)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'x'"):
        fb.gelu(torch.randn(3, requires_grad=True), approximate="x")
    with pytest.raises(ValueError, match="std must be > 0"):
        fb.normal(0.0, 0.0)


def test_custom_distribution_table() -> None:
    wide = fb.normal(0.0, 3.0)
    narrow = fb.get_table("gelu", 2)
    table = fb.get_table("gelu", 2, distribution=wide)
    assert table.distribution == wide.name
    assert table.borders != narrow.borders
    # the table is used through the generic entry point
    x = torch.randn(1000, requires_grad=True)
    y = fb.apply(x, F.gelu, fb.TableCode(table))
    (g,) = torch.autograd.grad(y.sum(), x)
    idx = torch.bucketize(x.detach(), torch.tensor(table.borders, dtype=torch.float32))
    assert torch.equal(g, torch.tensor(table.levels, dtype=torch.float32)[idx])
