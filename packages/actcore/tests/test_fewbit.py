"""Tests of actcore.fewbit's few-bit activations: forward and gradients against torch,
gradient error against the tables, bytes held, behaviour and errors, the modules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import grad_of
from torch import Tensor, nn

import actcore.fewbit as fb
from actcore import memory
from actcore.fewbit import function as fb_function
from actcore.fewbit import tables as fb_tables

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
