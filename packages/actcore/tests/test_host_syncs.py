"""No host synchronisation in a steady training step (the speed issue): a step that does
not replan calls none of the ops that make a device wait for the host to read a value or
size an output. Counted with the profiler on CPU, where these ops are the same calls
(the native CUDA kernels' own reads are the GPU check's business)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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
    "efficientnet_b0": _vision("efficientnet_b0"),
    "char_gpt": _gpt,
}


# The CPU tests run with actcore's CPU kernels, as by default (the pure-PyTorch reference of
# the masked ops finds the nonzeros by boolean indexing, which reads a count back).
@pytest.mark.usefixtures("native_cpu")
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


@pytest.mark.usefixtures("native_cpu")
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steady_step_does_not_synchronise() -> None:
    """On CUDA, with actcore's kernels: a steady L3 step (zero-value packing included) makes
    no synchronising call that plain PyTorch's step does not make too."""
    import warnings

    from actcore.compressors import zero_value
    from actcore.native import loader

    torchvision = pytest.importorskip("torchvision")
    if not loader.load(warn=False):
        pytest.skip(f"the CUDA kernels did not load: {loader.status()['error']}")
    x = torch.randn(8, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")

    def syncs(model: nn.Module, warm: int) -> list[str]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

        for _ in range(warm):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]

    torch.manual_seed(0)
    plain = syncs(torchvision.models.resnet18(num_classes=10).cuda(), 2)
    model = actcore.convert(torchvision.models.resnet18(num_classes=10), level="L3").cuda()
    model.act_adaptive.interval = INTERVAL
    converted = syncs(model, INTERVAL)  # the step after the first replan: a steady one
    assert len(converted) <= len(plain), (converted, plain)
    package = str(Path(actcore.__file__).parent)
    assert not [site for site in converted if site.startswith(package)], converted
    torch.cuda.synchronize()
    assert zero_value.settle() == 0  # every count has arrived: nothing left at full size


def test_count_calls_names_the_reads_back() -> None:
    """``count_calls`` counts a read-back where one happens: ``repeat_interleave`` sizing its
    output from a tensor of repeats reads a value back; with ``output_size`` or int repeats
    (as grouped-query attention calls it) it does not."""
    x, repeats = torch.randn(3, 4), torch.tensor([1, 2, 3])
    assert (
        count_calls(lambda: x.repeat_interleave(repeats, 0))[1].get("aten::_local_scalar_dense", 0)
        >= 1
    )
    assert count_calls(lambda: x.repeat_interleave(repeats, 0, output_size=6))[1] == {}
    assert count_calls(lambda: x.repeat_interleave(2, 0))[1] == {}
    assert count_calls(lambda: x.nonzero())[1] == {"aten::nonzero": 1}
    assert count_calls(lambda: x.sum().item())[1] == {"aten::_local_scalar_dense": 1}
