"""What several of actcore's test modules share: fixtures, and helpers they import
(``from conftest import forward_backward``; this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcore import cli
from actcore.config import config

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
