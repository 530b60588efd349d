"""What several of actcore's test modules share: fixtures, and helpers they import
(``from conftest import forward_backward``; this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcore import cli
from actcore.config import config
from actcore.dropit import to_dropit
from actcore.native import loader

if TYPE_CHECKING:
    from actcore.controller import Controller


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: as fast for tiny models, and far faster on a busy shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compress every saved tensor, however small (``config.min_numel = 0``)."""
    monkeypatch.setattr(config, "min_numel", 0)


def run_cli(args: list[str]) -> int:
    """``cli.main(args)``, with argparse's SystemExit turned into its code."""
    try:
        return cli.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)


def forward_backward(
    model: nn.Module, x: Tensor, *, seed: int | None = None, mean: bool = False
) -> tuple[Tensor, list[Tensor]]:
    """Backpropagate ``model(x).square()``, summed (or averaged), from zeroed gradients,
    seeding torch first when ``seed`` is given; returns the output and the parameters'
    gradients (copies, in ``model.parameters()`` order)."""
    model.zero_grad()
    if seed is not None:
        torch.manual_seed(seed)
    out = model(x)
    loss = out.square().mean() if mean else out.square().sum()
    loss.backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def flat(grads: Sequence[Tensor]) -> Tensor:
    """The tensors flattened into one vector."""
    return torch.cat([g.flatten() for g in grads])


def grad_cosine(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """Cosine similarity of two lists of gradients as flat vectors, in float64."""
    return float(F.cosine_similarity(flat(a).double(), flat(b).double(), dim=0))


def flat_grad(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The flat parameter gradient of the cross-entropy of ``model(x)`` against ``y``."""
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return flat([p.grad for p in model.parameters()])


def cross_entropy_backprop(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], Tensor]:
    """A ``backprop`` for :meth:`Controller.iterate`: the cross-entropy of ``model(x)``
    against ``y`` backpropagated from zeroed gradients (returns the loss)."""

    def backprop() -> Tensor:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return backprop


def train_iterations(c: Controller, backprop: Callable[[], object], iterations: int = 1) -> None:
    """``iterations`` iterations under ``c``'s hooks, each ``backprop()`` then
    ``c.iterate(backprop)`` (which adapts the bits when due), without an optimizer step."""
    with c:
        for _ in range(iterations):
            backprop()
            c.iterate(backprop)


def bn_mlp() -> nn.Sequential:
    """A seeded 64 -> 4 MLP with a batch norm (the adaptive-bits tests' model)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4)
    )


# ---- the few-bit activations' tests (test_fewbit.py, test_fewbit_linear.py)


def grad_of(fn, x: Tensor, grad_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(output, input gradient) of ``fn`` at a fresh leaf copy of ``x``."""
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf)
    y.backward(torch.ones_like(y) if grad_out is None else grad_out)
    return y.detach(), leaf.grad


# ---- DropIT's tests (test_dropit.py, test_dropit_convert.py)


def topk_mask(x: Tensor, gamma: float, per_sample: bool = False) -> Tensor:
    """Independent reference mask: elements at or above the k-th largest magnitude."""
    rows = x.shape[0] if per_sample else 1
    flat = x.detach().float().abs().reshape(rows, -1)
    k = flat.shape[1] - int(gamma * flat.shape[1] + 1e-6)
    threshold = flat.kthvalue(flat.shape[1] - k + 1, dim=1, keepdim=True).values
    return (flat >= threshold).reshape(x.shape)


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Random values whose magnitudes are all distinct in ``dtype`` (no ties to break)."""
    n = torch.Size(shape).numel()
    pool = torch.unique(torch.randn(8 * n + 64).to(dtype).abs())
    pool = pool[pool > 0]
    assert pool.numel() >= n
    values = pool[torch.randperm(pool.numel())[:n]]
    signs = torch.randint(0, 2, (n,)).to(dtype) * 2 - 1
    return (values * signs).reshape(shape)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One torch thread inside the block (the thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grads(module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output and the grads of (input, *parameters) for upstream gradient ``g``."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    params = list(module.parameters())
    return out, list(torch.autograd.grad(out, [x, *params], g))


def converted(module: nn.Module, gamma: float = 0.9, strategy: str = "mink") -> nn.Module:
    """A deep copy of ``module`` converted whole by ``to_dropit``."""
    new = copy.deepcopy(module)
    report = to_dropit(new, strategy, gamma)
    assert report.converted == [""]
    return new


# ---- the C++ CPU kernels' tests (test_native_cpu.py, test_native_cpu_loader.py)

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
CPU_KERNELS_TURNED_OFF = (
    loader.disabled() or os.environ.get("ACTCORE_NATIVE_CPU", "").lower() in loader._OFF
)


@pytest.fixture(scope="module")
def native_cpu() -> Iterator[None]:
    """The CPU kernels registered for the module's tests (restored to the default after)."""
    if CPU_KERNELS_TURNED_OFF:
        pytest.skip("CPU kernels turned off by ACTCORE_NATIVE / ACTCORE_NATIVE_CPU")
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler here to build the CPU kernels with")
    with loader.cpu_kernels(True) as active:
        if not active:  # a compiler is here: a failure is a bug
            pytest.fail(f"the CPU kernels did not load: {loader.cpu_status()['error']}")
        yield
