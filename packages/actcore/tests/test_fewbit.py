"""Tests of actcore.fewbit: few-bit activations, their tables, RandomizedLinear, surgery."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import integrate, special
from torch import Tensor, nn

import actcore.fewbit as fb
from actcore import memory
from actcore.fewbit import function as fb_function
from actcore.fewbit import tables as fb_tables
from actcore.fewbit.derivatives import DERIVATIVES
from actcore.fewbit.optimal import fit_piecewise_constant, uniform
from actcore.fewbit.randomized import projection

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}

# name: (few-bit call, torch call, points where torch's derivative jumps)
PIECEWISE = {
    "relu": (fb.relu, F.relu, [0.0]),
    "leaky_relu": (
        lambda x, **k: fb.leaky_relu(x, 0.1, **k),
        lambda x: F.leaky_relu(x, 0.1),
        [0.0],
    ),
    "threshold": (
        lambda x, **k: fb.threshold(x, 0.3, -2.0, **k),
        lambda x: F.threshold(x, 0.3, -2.0),
        [0.3],
    ),
    "hardsigmoid": (fb.hardsigmoid, F.hardsigmoid, [-3.0, 3.0]),
    "hardtanh": (
        lambda x, **k: fb.hardtanh(x, -0.7, 1.3, **k),
        lambda x: F.hardtanh(x, -0.7, 1.3),
        [-0.7, 1.3],
    ),
    "relu6": (fb.relu6, F.relu6, [0.0, 6.0]),
    "hardshrink": (
        lambda x, **k: fb.hardshrink(x, 0.3, **k),
        lambda x: F.hardshrink(x, 0.3),
        [-0.3, 0.3],
    ),
    "softshrink": (fb.softshrink, F.softshrink, [-0.5, 0.5]),
}

# key (as in the tables): (few-bit call taking bits=, torch call)
CONTINUOUS = {
    "celu": (fb.celu, F.celu),
    "elu": (fb.elu, F.elu),
    "gelu": (fb.gelu, F.gelu),
    "gelu(approximate='tanh')": (
        lambda x, **k: fb.gelu(x, approximate="tanh", **k),
        lambda x: F.gelu(x, approximate="tanh"),
    ),
    "hardswish": (fb.hardswish, F.hardswish),
    "logsigmoid": (fb.logsigmoid, F.logsigmoid),
    "mish": (fb.mish, F.mish),
    "selu": (fb.selu, F.selu),
    "sigmoid": (fb.sigmoid, torch.sigmoid),
    "silu": (fb.silu, F.silu),
    "softplus": (fb.softplus, F.softplus),
    "softsign": (fb.softsign, F.softsign),
    "tanh": (fb.tanh, torch.tanh),
    "tanhshrink": (fb.tanhshrink, F.tanhshrink),
}
ALL = {**{k: v[:2] for k, v in PIECEWISE.items()}, **CONTINUOUS}

# few-bit module, the torch module it must subclass, the functional it must match
MODULES = [
    (fb.ReLU(), nn.ReLU, fb.relu),
    (fb.LeakyReLU(0.2), nn.LeakyReLU, lambda x: fb.leaky_relu(x, 0.2)),
    (fb.Threshold(0.1, 20.0), nn.Threshold, lambda x: fb.threshold(x, 0.1, 20.0)),
    (fb.Hardsigmoid(), nn.Hardsigmoid, fb.hardsigmoid),
    (fb.Hardtanh(-2.0, 2.0), nn.Hardtanh, lambda x: fb.hardtanh(x, -2.0, 2.0)),
    (fb.ReLU6(), nn.ReLU6, fb.relu6),
    (fb.Hardshrink(0.4), nn.Hardshrink, lambda x: fb.hardshrink(x, 0.4)),
    (fb.Softshrink(0.4), nn.Softshrink, lambda x: fb.softshrink(x, 0.4)),
    (fb.CELU(bits=2), nn.CELU, lambda x: fb.celu(x, bits=2)),
    (fb.ELU(alpha=0.5, bits=4), nn.ELU, lambda x: fb.elu(x, 0.5, bits=4)),
    (fb.GELU(approximate="tanh"), nn.GELU, lambda x: fb.gelu(x, "tanh")),
    (fb.Hardswish(), nn.Hardswish, fb.hardswish),
    (fb.LogSigmoid(bits=1), nn.LogSigmoid, lambda x: fb.logsigmoid(x, bits=1)),
    (fb.Mish(), nn.Mish, fb.mish),
    (fb.SELU(), nn.SELU, fb.selu),
    (fb.Sigmoid(), nn.Sigmoid, fb.sigmoid),
    (fb.SiLU(bits=2), nn.SiLU, lambda x: fb.silu(x, bits=2)),
    (fb.Softplus(2.0, 5.0, bits=2), nn.Softplus, lambda x: fb.softplus(x, 2.0, 5.0, bits=2)),
    (fb.Softsign(), nn.Softsign, fb.softsign),
    (fb.Tanh(bits=4), nn.Tanh, lambda x: fb.tanh(x, bits=4)),
    (fb.Tanhshrink(), nn.Tanhshrink, fb.tanhshrink),
]


def grad_of(fn, x: Tensor, grad_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(output, input gradient) of ``fn`` at a fresh leaf copy of ``x``."""
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf)
    y.backward(torch.ones_like(y) if grad_out is None else grad_out)
    return y.detach(), leaf.grad


def saved_bytes(y: Tensor) -> int:
    """Bytes that ``y``'s autograd node keeps (its saved tensors)."""
    return sum(t.numel() * t.element_size() for t in y.grad_fn.saved_tensors if t is not None)


def sample(n: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 3.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


# --------------------------------------------------------------------------------------------
# Forward and exactness
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(ALL))
def test_forward_bitwise_equal_to_torch(name: str, dtype: torch.dtype) -> None:
    ours, ref = ALL[name]
    kinks = PIECEWISE[name][2] if name in PIECEWISE else [0.0]
    x = torch.cat([sample(4096 - len(kinks), 1, dtype), torch.tensor(kinks, dtype=dtype)])
    x = x.view(64, 64).t()  # non-contiguous
    leaf = x.detach().requires_grad_()
    y = ours(leaf)
    expected = ref(x)
    assert y.dtype == expected.dtype == dtype and y.shape == expected.shape
    assert torch.equal(y, expected)
    assert y.grad_fn is not None  # the few-bit path ran


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(PIECEWISE))
def test_piecewise_gradient_is_torchs_exactly(name: str, dtype: torch.dtype) -> None:
    ours, ref, kinks = PIECEWISE[name]
    specials = [*kinks, 0.0, -0.0, math.inf, -math.inf]  # (torch is inconsistent on NaN)
    x = torch.cat([sample(2000, 2, dtype), torch.tensor(specials, dtype=dtype)])
    x = torch.cat([x, torch.tensor(kinks, dtype=dtype).repeat(8)])
    g = sample(x.numel(), 3, dtype, scale=1.0)
    _, grad = grad_of(ours, x, g)
    _, expected = grad_of(ref, x, g)
    assert torch.equal(grad, expected), (grad - expected).abs().max()
    assert saved_bytes(ours(x.clone().requires_grad_())) == math.ceil(x.numel() / 8)


def test_piecewise_bits_argument_is_checked_and_storage_stays_1_bit() -> None:
    x = torch.randn(800, requires_grad=True)
    assert saved_bytes(fb.relu(x, bits=4)) == 100
    with pytest.raises(ValueError, match=r"1\.\.4.*got 7"):
        fb.leaky_relu(x, bits=7)


# --------------------------------------------------------------------------------------------
# Continuous activations: measured gradient error equals the table's L2 error
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONTINUOUS))
def test_gradient_error_matches_table(name: str) -> None:
    """Over x ~ N(0, 1) and grad_out = 1, mean (ours - torch's)^2 estimates the table's
    E[(f' - c)^2]: agree within 5 standard errors (plus fp32 rounding)."""
    ours, ref = CONTINUOUS[name]
    x = sample(1 << 18, 4, scale=1.0)
    _, exact = grad_of(ref, x)
    previous = math.inf
    for bits in range(1, 5):
        table = fb_tables.shipped_tables()[name][bits]
        _, approx = grad_of(lambda t, b=bits: ours(t, bits=b), x)
        err = (approx.double() - exact.double()).pow(2)
        mean, sem = err.mean().item(), err.std().item() / math.sqrt(err.numel())
        assert abs(mean - table.l2_error) <= 5 * sem + 1e-3 * table.l2_error + 1e-10, (
            bits,
            mean,
            table.l2_error,
            sem,
        )
        assert table.l2_error < previous  # each bit helps
        previous = table.l2_error


def test_parameterised_table_is_computed_once_and_matches() -> None:
    x = sample(1 << 16, 5, scale=1.0)
    t0 = fb_tables.get_table("elu", 2, alpha=0.5)
    assert t0 is fb_tables.get_table("elu", 2, alpha=0.5)  # memoised
    assert t0.key == "elu(alpha=0.5)" and t0.levels != fb_tables.get_table("elu", 2).levels
    _, exact = grad_of(lambda t: F.elu(t, alpha=0.5), x)
    _, approx = grad_of(lambda t: fb.elu(t, alpha=0.5, bits=2), x)
    err = (approx.double() - exact.double()).pow(2)
    sem = err.std().item() / math.sqrt(err.numel())
    assert abs(err.mean().item() - t0.l2_error) <= 5 * sem + 1e-10


def test_gelu_3bit_error_small_and_levels_in_range() -> None:
    table = fb.get_table("gelu", 3)
    assert table.distribution == "normal(mean=0.0, std=1.0)" and not table.folded
    assert len(table.borders) == 7 and len(table.levels) == 8
    assert list(table.borders) == sorted(table.borders)
    assert table.relative_error < 0.01  # 3 bits leave < 1% of Var[gelu']
    assert min(table.levels) > -0.2 and max(table.levels) < 1.2


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


# --------------------------------------------------------------------------------------------
# Bytes held
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_bytes_per_element_is_bits_over_8(bits: int) -> None:
    x = torch.randn(4096, 8, requires_grad=True)
    y = fb.gelu(x, bits=bits)
    assert saved_bytes(y) == x.numel() * bits // 8
    (packed,) = y.grad_fn.saved_tensors
    assert packed.dtype == torch.uint8


def test_3bit_gelu_holds_over_9x_fewer_bytes_than_torch() -> None:
    x = torch.randn(16, 1024, requires_grad=True)
    with memory.track(nn.Sequential(nn.GELU())) as plain:
        y0 = nn.Sequential(nn.GELU())(x)
    model = nn.Sequential(fb.GELU(bits=3))
    with memory.track(model) as few:
        y1 = model(x)
    assert plain.retained_bytes == x.numel() * 4
    assert few.retained_bytes == x.numel() * 3 // 8
    assert plain.retained_bytes / few.retained_bytes >= 9  # 32 / 3 = 10.7
    del y0, y1


def _bert_mlp(gelu: nn.Module, linear=nn.Linear) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(linear(768, 3072), gelu, linear(3072, 768))


def test_bert_mlp_retained_bytes() -> None:
    """BERT-base MLP block (768 -> 3072 -> 768), batch 8 x 128 tokens, fp32."""
    x = torch.randn(8, 128, 768)
    tokens = 8 * 128
    reports = {}
    for label, model in {
        "torch": _bert_mlp(nn.GELU()),
        "3-bit GELU": _bert_mlp(fb.GELU(bits=3)),
        "3-bit GELU + RandomizedLinear(0.2)": fb.convert_linear(
            _bert_mlp(fb.GELU(bits=3)), fb.RandomizedLinear, proj_ratio=0.2
        ),
    }.items():
        with memory.track(model) as rep:
            out = model(x)
        reports[label] = rep.retained_bytes
        out.sum().backward()  # and it trains
        assert model[0].weight.grad is not None
    k = math.ceil(0.2 * tokens)
    assert reports["torch"] == (tokens * 768 + 2 * tokens * 3072) * 4  # x, gelu in, gelu out
    assert reports["3-bit GELU"] == tokens * 768 * 4 + tokens * 3072 * 3 // 8 + tokens * 3072 * 4
    assert reports["3-bit GELU + RandomizedLinear(0.2)"] == (
        k * 768 * 4 + tokens * 3072 * 3 // 8 + k * 3072 * 4
    )
    base = reports["torch"]
    for label, held in reports.items():
        print(f"BERT MLP {label}: {held / 2**20:.3f} MiB held ({1 - held / base:.1%} saved)")
    assert reports["3-bit GELU"] <= 0.6 * base  # 16.1 MiB vs 27 MiB


# --------------------------------------------------------------------------------------------
# Behaviour: no_grad, in-place, layouts, dtypes, errors
# --------------------------------------------------------------------------------------------


def test_no_index_computed_without_grad(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("few-bit path taken without grad")

    monkeypatch.setattr(fb_function._FewBitFunction, "apply", fail)
    monkeypatch.setattr(fb_function.ops, "pack_bits", fail)
    x = torch.randn(100)
    assert torch.equal(fb.gelu(x), F.gelu(x))
    with torch.no_grad():
        xr = x.clone().requires_grad_()
        assert torch.equal(fb.silu(xr), F.silu(x)) and fb.relu(xr).grad_fn is None


def test_inplace_matches_torch() -> None:
    x = torch.randn(1000)
    for ours, ref in [(fb.relu, F.relu), (fb.elu, F.elu), (fb.hardtanh, F.hardtanh)]:
        a = x.clone().requires_grad_()
        h = a * 2.0
        y = ours(h, inplace=True)
        assert y is h and y._version > 0
        b = x.clone().requires_grad_()
        h_ref = b * 2.0
        assert torch.equal(y, ref(h_ref, inplace=True))
        y.backward(torch.ones_like(y))
        h_ref.backward(torch.ones_like(h_ref))
        if ours is fb.elu:  # 3-bit table
            assert (a.grad - b.grad).pow(2).mean() < 0.01
        else:
            assert torch.equal(a.grad, b.grad)
    with pytest.raises(RuntimeError, match="leaf"):
        fb.relu(torch.randn(3, requires_grad=True), inplace=True)


def test_layouts_empty_and_half_gradients() -> None:
    base = torch.randn(48, 80)
    _, g_contig = grad_of(fb.gelu, base.t().contiguous())
    _, g_strided = grad_of(fb.gelu, base.t())
    assert torch.equal(g_contig, g_strided)
    y, g = grad_of(fb.gelu, torch.empty(0, 5))
    assert y.shape == g.shape == (0, 5)
    for dtype in (torch.float16, torch.bfloat16):
        x = sample(1 << 14, 6, dtype, scale=1.0)
        y, g = grad_of(fb.gelu, x)
        assert g.dtype == dtype
        _, g32 = grad_of(fb.gelu, x.float())  # same codes: half inputs compare in fp32
        assert torch.equal(g, g32.to(dtype))
        assert saved_bytes(fb.gelu(x.requires_grad_())) == x.numel() * 3 // 8


def test_double_backward_is_refused() -> None:
    x = torch.randn(10, requires_grad=True)
    (g,) = torch.autograd.grad(fb.tanh(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("bad", [0, 5, -1])
def test_bits_out_of_range(bad: int) -> None:
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match=rf"bits must be in 1\.\.4, got {bad}"):
        fb.gelu(x, bits=bad)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        fb.GELU(bits=bad)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        fb.get_table("tanh", bad)
    with torch.no_grad(), pytest.raises(ValueError, match=r"1\.\.4"):
        fb.sigmoid(x, bits=bad)  # checked even when nothing is saved


def test_bits_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"int in 1\.\.4, got 2\.0"):
        fb.Tanh(bits=2.0)
    with pytest.raises(TypeError, match="got True"):
        fb.gelu(torch.randn(2, requires_grad=True), bits=True)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", MODULES, ids=lambda e: type(e[0]).__name__)
def test_modules_are_drop_in(entry) -> None:
    module, torch_cls, functional = entry
    assert isinstance(module, torch_cls)
    assert module.state_dict() == {}
    assert f"bits={module.bits}" in repr(module) and repr(module).startswith(torch_cls.__name__)
    x = sample(512, 7).view(8, 64)
    y, g = grad_of(module, x)
    assert torch.equal(y, torch_cls.forward(module, x))  # torch's forward, same attributes
    y_fun, g_fun = grad_of(functional, x)
    assert torch.equal(y, y_fun) and torch.equal(g, g_fun)
    exact = (nn.ReLU, nn.LeakyReLU, nn.Threshold, nn.Hardsigmoid, nn.Hardtanh, nn.Hardshrink)
    if isinstance(module, (*exact, nn.Softshrink)):  # piecewise: torch's gradient exactly
        assert torch.equal(g, grad_of(lambda t: torch_cls.forward(module, t), x)[1])


# --------------------------------------------------------------------------------------------
# RandomizedLinear
# --------------------------------------------------------------------------------------------


def test_randomized_linear_forward_and_exact_gradients() -> None:
    torch.manual_seed(0)
    lin = fb.RandomizedLinear(24, 10)
    ref = nn.Linear(24, 10)
    ref.load_state_dict(lin.state_dict())
    assert isinstance(lin, nn.Linear) and list(lin.state_dict()) == ["weight", "bias"]
    assert "proj_ratio=0.2" in repr(lin) and "gaussian" in repr(lin)
    x = torch.randn(6, 20, 24)
    g = torch.randn(6, 20, 10)
    y, gx = grad_of(lin, x, g)
    y_ref, gx_ref = grad_of(ref, x, g)
    assert torch.equal(y, y_ref)
    assert torch.allclose(gx, gx_ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    assert lin.weight.grad.shape == ref.weight.grad.shape
    assert not torch.allclose(lin.weight.grad, ref.weight.grad)  # it is an estimate


def test_randomized_linear_full_ratio_is_exact() -> None:
    torch.manual_seed(1)
    lin = fb.RandomizedLinear(8, 5, proj_ratio=1.0, distribution="rademacher")
    ref = nn.Linear(8, 5)
    ref.load_state_dict(lin.state_dict())
    x, g = torch.randn(30, 8), torch.randn(30, 5)
    grad_of(lin, x, g)
    grad_of(ref, x, g)
    assert torch.allclose(lin.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


@pytest.fixture
def one_thread():
    """Thousands of tiny ops: threads only add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_randomized_linear_weight_gradient_is_unbiased(distribution: str) -> None:
    gen = torch.Generator().manual_seed(2)
    n, d_in, d_out, seeds = 40, 6, 5, 2000
    x = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64).requires_grad_()
    g = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    exact = g.t() @ x
    draws = []
    for seed in range(seeds):
        y = fb.randomized_linear(x, w, None, 0.2, distribution, seed=seed)
        (gw,) = torch.autograd.grad(y, w, g)
        draws.append(gw)
    draws = torch.stack(draws)
    mean, var = draws.mean(0), draws.var(0)
    z = (mean - exact) / (var / seeds).sqrt()
    assert (z.abs() <= 5).all(), z
    dof = z.numel()
    assert (z**2).sum() <= dof + 6 * math.sqrt(2 * dof)  # chi-square aggregate
    assert (var > 0).all()
    # same seed, same S: deterministic
    y = fb.randomized_linear(x, w, None, 0.2, distribution, seed=7)
    assert torch.equal(torch.autograd.grad(y, w, g)[0], draws[7])


def test_projection_has_identity_second_moment() -> None:
    n, k = 30, 12
    eye = torch.eye(n, dtype=torch.float64)
    for dist in ("gaussian", "rademacher"):
        acc = sum(projection(eye, k, s, dist).t() @ projection(eye, k, s, dist) for s in range(400))
        assert torch.allclose(acc / 400, eye, atol=0.25)
        if dist == "rademacher":
            assert torch.allclose(projection(eye, k, 0, dist).abs(), torch.tensor(k**-0.5).double())


def test_randomized_linear_keeps_a_fifth_of_the_input() -> None:
    lin = fb.RandomizedLinear(64, 32, proj_ratio=0.2)
    x = torch.randn(10, 100, 64, requires_grad=True)
    with memory.track(lin) as rep:
        y = lin(x)
    k = math.ceil(0.2 * 1000)
    assert rep.retained_bytes == k * 64 * 4
    assert rep.retained_bytes <= 0.25 * x.numel() * 4
    y.sum().backward()
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    with memory.track(lin) as rep:
        lin(x)
    assert rep.retained_bytes == 0  # frozen weight: nothing of the input is kept


def test_randomized_linear_autocast_and_bad_arguments() -> None:
    lin = fb.RandomizedLinear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"proj_ratio must be in \(0, 1\], got {bad}"):
            fb.RandomizedLinear(4, 4, proj_ratio=bad)
    with pytest.raises(ValueError, match="'uniform'"):
        fb.RandomizedLinear(4, 4, distribution="uniform")


# --------------------------------------------------------------------------------------------
# map_module, convert_linear
# --------------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), self.shared)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Tanh()})
        self.attn = nn.MultiheadAttention(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(self.body(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.heads["a"](self.heads["b"](h))


def test_map_module_paths_order_sharing_and_root() -> None:
    net = _Net()
    seen: list[str] = []

    def fn(m: nn.Module, path: str) -> nn.Module:
        seen.append(path)
        if isinstance(m, nn.GELU):
            return fb.GELU(bits=2)
        if isinstance(m, nn.Tanh):
            return fb.Tanh()
        return m

    assert fb.map_module(net, fn) is net
    assert set(seen) == {name for name, _ in net.named_modules()}
    assert seen[-1] == "" and seen.index("body.1") < seen.index("body")  # post-order
    assert isinstance(net.body[1], fb.GELU) and net.body[1].bits == 2
    assert isinstance(net.heads["b"], fb.Tanh)
    new_root = fb.map_module(net, lambda m, p: nn.Sequential(m) if p == "" else m)
    assert isinstance(new_root, nn.Sequential) and new_root[0] is net
    with pytest.raises(TypeError, match=r"must return an nn\.Module, got NoneType for 'shared'"):
        fb.map_module(_Net(), lambda m, p: None if p == "shared" else m)


def test_map_module_replaces_a_shared_module_once() -> None:
    net = _Net()
    calls = []

    def fn(m: nn.Module, path: str) -> nn.Module:
        if m is net.shared:
            calls.append(path)
            return nn.Identity()
        return m

    fb.map_module(net, fn)
    assert calls == ["shared"]
    assert isinstance(net.shared, nn.Identity) and net.body[3] is net.shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_convert_linear_preserves_state(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    net = _Net().to(dtype)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = {k: id(p) for k, p in net.named_parameters()}
    x = torch.randn(5, 4, dtype=dtype)
    y_before = net(x)
    assert fb.convert_linear(net, fb.RandomizedLinear, proj_ratio=0.5) is net
    assert type(net.body[0]) is fb.RandomizedLinear and net.body[0].proj_ratio == 0.5
    assert type(net.heads["a"]) is fb.RandomizedLinear and net.body[3] is net.shared
    assert type(net.attn.out_proj) is not fb.RandomizedLinear  # a Linear subclass: kept
    after = net.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value) and after[key].dtype == dtype
    assert {k: id(p) for k, p in net.named_parameters()} == params  # same Parameters
    assert torch.equal(net(x), y_before)
    again = fb.convert_linear(net, fb.RandomizedLinear, proj_ratio=0.1)
    assert again.body[0].proj_ratio == 0.5  # already converted layers stay as they are
    single = fb.convert_linear(nn.Linear(3, 2, bias=False), fb.RandomizedLinear)
    assert type(single) is fb.RandomizedLinear and single.bias is None
