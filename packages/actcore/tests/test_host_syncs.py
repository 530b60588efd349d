"""No host synchronisation in a steady training step (the speed issue): a step that does
not replan calls none of the ops that make a device wait for the host to read a value or
size an output. Counted with the profiler on CPU, where these ops are the same calls
(the native CUDA kernels' own reads are the GPU check's business)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.bench.calls import count_calls
from actcore.bench.gpt import CharGPT, GPTConfig

INTERVAL = 5  # adaptive bits replan every 5 steps here (statistics on the 4 before)
STEPS = 11


def _syncs_per_step(step: Callable[[], None]) -> list[dict[str, int]]:
    return [count_calls(step)[1] for _ in range(STEPS)]


def _vision(name: str) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    def build() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        torchvision = pytest.importorskip("torchvision")
        model = getattr(torchvision.models, name)(num_classes=10)
        x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
        return model, lambda m: F.cross_entropy(m(x), y)

    return build


def _gpt() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = CharGPT(GPTConfig(vocab_size=40, context=32, layers=2, heads=2, width=32))
    ids = torch.randint(0, 40, (2, 33))
    return model, lambda m: m(ids[:, :-1], ids[:, 1:])


MODELS = {
    "resnet18": _vision("resnet18"),
    "mobilenet_v3_small": _vision("mobilenet_v3_small"),
    "char_gpt": _gpt,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_route_steady_steps_do_not_synchronise(name: str) -> None:
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    actcore.convert(model)  # the default level: adaptive bits
    model.act_adaptive.interval = INTERVAL

    def step() -> None:
        loss_of(model).backward()

    counts = _syncs_per_step(step)
    replans = {i for i in range(STEPS) if (i + 1) % INTERVAL == 0}
    steady = {i: c for i, c in enumerate(counts) if i not in replans and c}
    assert steady == {}, steady
    assert all(counts[i] for i in replans)  # (the replans read their statistics back)


def test_hooks_route_steady_steps_do_not_synchronise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    controller = actcore.Controller(model, "G2", adapt_interval=INTERVAL)
    controller.install_hook()

    def backprop() -> None:
        F.cross_entropy(model(x), y).backward()

    def step() -> None:
        backprop()
        controller.iterate(backprop)

    try:
        counts = _syncs_per_step(step)
    finally:
        controller.uninstall_hook()
    estimated = {i for i, c in enumerate(counts) if c}
    # the auto-precision policy estimates (reading back) on its adapt steps only
    assert len(estimated) <= 1 + STEPS // INTERVAL, counts
