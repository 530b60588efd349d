"""Ops whose backward compares or divides saved values keep them exact under the hooks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actcore import Controller
from actcore.saved_tensors.exact_ops import ExactOps, needs_exact_saves
from actcore.saved_tensors.hooks import SavedTensorHooks, compress_saved_tensors

INF = math.inf
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
IDX2D = torch.arange(16 * 64).reshape(16, 64) % 8  # rows of h into 8 output rows
IDX1D = torch.arange(16) % 8

CASES = {
    "amax": lambda h: h.amax(-1),
    "amin": lambda h: torch.amin(h, dim=0),
    "max_full": lambda h: h.max(),
    "min_full": lambda h: torch.min(h),
    "maximum": lambda h: torch.maximum(h, h.flip(-1)),
    "fmin": lambda h: torch.fmin(h, h.roll(1, 0)),
    "median": lambda h: torch.median(h),
    "norm_inf": lambda h: h.norm(p=INF, dim=-1),
    "vector_norm_inf": lambda h: torch.linalg.vector_norm(h, ord=-INF, dim=0),
    "normalize_inf": lambda h: F.normalize(h, p=INF, dim=-1),
    "scatter_reduce_amax": lambda h: torch.zeros(8, 64).scatter_reduce(
        0, IDX2D, h, "amax", include_self=False
    ),
    "scatter_reduce__amin": lambda h: h.new_zeros(8, 64).scatter_reduce_(
        0, IDX2D, h, reduce="amin", include_self=False
    ),
    "index_reduce_amax": lambda h: torch.zeros(8, 64).index_reduce(
        0, IDX1D, h, "amax", include_self=False
    ),
    "prod": lambda h: (1.0 + 0.05 * h).prod(-1),
    "logsumexp": lambda h: torch.logsumexp(8.0 * h, -1),
}


def _grad(op, h0: torch.Tensor, hooks) -> torch.Tensor:
    h = h0.clone().requires_grad_(True)
    with hooks:
        # cos saves h first (compressed); the op then saves the same storage again, and
        # must get it exact rather than the compressed copy the dedup would hand back
        side = torch.cos(h).sum()
        out = op(h)
    weights = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    (out * weights).sum().add(0.0 * side).backward()
    return h.grad


@pytest.mark.parametrize("name", list(CASES))
def test_comparing_ops_get_exact_gradients_at_two_bits(name: str) -> None:
    torch.manual_seed(0)
    h0 = torch.randn(16, 64)
    plain = _grad(CASES[name], h0, torch.enable_grad())
    packed = _grad(CASES[name], h0, compress_saved_tensors(2, min_numel=1))
    assert torch.isfinite(plain).all()
    assert torch.equal(packed, plain)


@pytest.mark.parametrize("name", ["amax", "scatter_reduce_amax", "norm_inf", "prod"])
def test_without_exact_ops_the_same_gradients_are_wrong(name: str) -> None:
    # what the mode prevents: quantized saves break equality tests (NaN/zero gradients)
    torch.manual_seed(0)
    h0 = torch.randn(16, 64)
    plain = _grad(CASES[name], h0, torch.enable_grad())
    packed = _grad(CASES[name], h0, compress_saved_tensors(2, min_numel=1, exact_ops=False))
    assert not torch.allclose(packed, plain, atol=1e-3, equal_nan=False)


def test_saves_outside_comparing_ops_are_still_compressed() -> None:
    hooks = SavedTensorHooks(2, min_numel=1)
    handles = []
    pack = hooks.pack
    hooks.pack = lambda t: handles.append(pack(t)) or handles[-1]  # type: ignore[method-assign]
    h = torch.randn(16, 64, requires_grad=True)
    with hooks:
        torch.sin(h)  # saves h: compressed
        h.amax(-1)  # saves h and its result: exact
        torch.exp(h)  # saves its result: compressed
    assert [x.stored is not None for x in handles] == [True, False, False, True]
    assert not hooks.active and torch._C._len_torch_function_stack() == 0  # mode popped


def test_reduce_argument_and_norm_order_decide() -> None:
    x, i = torch.randn(4, 4), torch.zeros(4, 4, dtype=torch.long)
    assert needs_exact_saves(torch.Tensor.scatter_reduce, (x, 0, i, x, "amax"))
    assert needs_exact_saves(torch.scatter_reduce, (x, 0, i, x), {"reduce": "prod"})
    assert not needs_exact_saves(torch.Tensor.scatter_reduce, (x, 0, i, x, "sum"))
    assert not needs_exact_saves(torch.Tensor.scatter_reduce_, (x, 0, i, x, "mean"))
    assert needs_exact_saves(torch.linalg.vector_norm, (x,), {"ord": -INF})
    assert not needs_exact_saves(torch.linalg.vector_norm, (x, 2))
    assert not needs_exact_saves(torch.Tensor.norm, (x,))
    assert not needs_exact_saves(torch.sin, (x,))

    class Unhashable:
        __hash__ = None

        def __call__(self, *args: object) -> None:
            pass

    assert not needs_exact_saves(Unhashable(), (x,))


def test_mode_depth_counts_nested_calls_and_unwinds_on_error() -> None:
    mode = ExactOps()
    seen = []
    h = torch.randn(8, 8)
    with mode:
        torch.sin(h).amax()
        seen.append(mode.depth)
        with pytest.raises(IndexError):
            h.amax(dim=5)
    assert seen == [0] and mode.depth == 0


def test_controller_passes_exact_ops_to_its_hooks() -> None:
    model = torch.nn.Linear(8, 8)
    assert Controller(model, "G1.2").saved_tensor_hooks.exact_ops is True
    assert Controller(model, "G1.2", exact_ops=False).saved_tensor_hooks.exact_ops is False
