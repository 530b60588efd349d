"""Every compressor states whether ``E[unpack(pack(x))] == x`` (``Compressor.unbiased``), and
the statement holds: the mean of n restorations of an unbiased one approaches ``x`` like
1/sqrt(n); a biased one's does not. The default level keeps nothing biased but the outputs
of smooth activations rebuilt from their rounded inputs (bias measured in
test_unbiased.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import actcore
from actcore import ops
from actcore.compressors import Compressor
from actcore.compressors.channel_scaled import ChannelScaled
from actcore.compressors.derived import Derived
from actcore.compressors.mask_bits import MaskBits
from actcore.compressors.per_sample_quantize import PerSampleQuantize
from actcore.compressors.quantize import Quantize
from actcore.compressors.swap import Swap
from actcore.compressors.zero_value import ZeroValue

N = 256


def _relative_errors(comp: Compressor, x: torch.Tensor) -> tuple[float, float]:
    """(relative error of one restoration, of the mean of N restorations)."""
    torch.manual_seed(0)
    total = torch.zeros_like(x, dtype=torch.float64)
    first = None
    for _ in range(N):
        tensors, meta = comp.pack(x)
        y = comp.unpack(tensors, meta).double()
        first = y if first is None else first
        total += y
    norm = x.double().norm()
    return float((first - x).norm() / norm), float((total / N - x).norm() / norm)


def _relu_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.relu(torch.randn(8, 300, generator=g))


def _cases() -> list[tuple[str, Compressor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 300, generator=g)
    outlier = x.clone()
    outlier[:, 7] *= 200.0
    relu = _relu_input()
    mask = ops.pack_mask(relu != 0)
    return [
        ("quantize-2", Quantize(2), x),
        ("quantize-4-flat", Quantize(4, per_sample=False), x),
        ("per-sample", PerSampleQuantize(((4, 4), (2, 4))), x),
        ("zero-value", ZeroValue(mask, Quantize(2, per_sample=False)), relu),
        ("channel-scaled", ChannelScaled(Quantize(2), dim=-1, exact=1), outlier),
        ("swap", Swap(Quantize(2)), x),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_an_unbiased_compressor_averages_to_its_input(case) -> None:
    _, comp, x = case
    assert comp.lossy and comp.unbiased
    one, mean = _relative_errors(comp, x)
    assert one > 0.01  # lossy indeed
    # unbiased: the error of the mean falls like 1/sqrt(N) (1.5x slack for the estimate)
    assert mean <= 1.5 * one / math.sqrt(N)


def test_rounding_to_nearest_is_declared_biased_and_is() -> None:
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    comp = Quantize(2, stochastic=False)
    assert not comp.unbiased
    one, mean = _relative_errors(comp, x)
    assert mean > 0.9 * one  # the same rounding every time: no averaging out


def test_exact_compressors_are_unbiased() -> None:
    assert Compressor().unbiased and not Compressor().lossy
    assert MaskBits().unbiased
    x = torch.rand(5, 17) > 0.5
    tensors, meta = MaskBits().pack(x)
    assert torch.equal(MaskBits().unpack(tensors, meta), x)


def _derived(fn, affine: bool, x: torch.Tensor) -> tuple[Derived, tuple, tuple]:
    part = Quantize(2)
    tensors, meta = part.pack(x)
    return Derived(fn, (part,), affine), tensors, ((meta,), (len(tensors),))


def test_derived_is_unbiased_only_through_an_affine_function() -> None:
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(4))
    x[:, 3] *= 50.0  # a curved function of a coarse rounding: a visible bias

    def mean_error(fn, affine: bool) -> tuple[bool, float, float]:
        torch.manual_seed(0)
        total = torch.zeros_like(x, dtype=torch.float64)
        first = None
        for _ in range(N):
            comp, tensors, meta = _derived(fn, affine, x)
            y = comp.unpack(tensors, meta).double()
            first = y if first is None else first
            total += y
        exact = fn(x).double()
        norm = exact.norm()
        return (
            comp.unbiased,
            float((first - exact).norm() / norm),
            float((total / N - exact).norm() / norm),
        )

    unbiased, one, mean = mean_error(lambda t: 3.0 * t + 1.0, True)
    assert unbiased and mean <= 1.5 * one / math.sqrt(N)
    unbiased, one, mean = mean_error(torch.tanh, False)
    assert not unbiased and mean > 3.0 * one / math.sqrt(N)  # the bias floor shows
    # an affine function of a biased part is biased
    assert not Derived(lambda t: t, (Quantize(2, stochastic=False),), True).unbiased


def _kept_compressors(out: torch.Tensor) -> list[Compressor]:
    """The compressors of every packing behind ``out``'s graph (Q-layers' ``act_plan``)."""
    seen, todo, comps = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for _, comp, _ in getattr(node, "act_plan", None) or ():
            if comp is not None:
                comps.append(comp)
        todo.extend(n for n, _ in node.next_functions)
    return comps


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.norm = nn.LayerNorm(16 * 8 * 8)
        self.mlp = nn.Sequential(nn.Linear(16 * 8 * 8, 256), nn.GELU(), nn.Linear(256, 10))
        self.gate = nn.Linear(16 * 8 * 8, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x).flatten(1))
        gated = torch.nn.functional.silu(self.gate(h)) * self.mlp[0](h)
        return self.mlp[2](self.mlp[1](self.mlp[0](h))) + self.mlp[2](gated)


def test_the_default_level_keeps_only_unbiased_packings_but_smooth_activation_outputs() -> None:
    torch.manual_seed(0)
    model = actcore.convert(_Net())
    out = model(torch.randn(8, 3, 16, 16))  # every saved tensor >= config.min_numel
    comps = _kept_compressors(out)
    lossy = [c for c in comps if c.lossy]
    assert len(lossy) >= 6
    biased = [c for c in lossy if not c.unbiased]
    # the only biased packings: outputs rebuilt through a curved function (GELU, SiLU) of
    # their rounded input, and products with such an output as a factor
    assert biased and all(isinstance(c, Derived) for c in biased)
    for c in biased:
        assert not c.affine or any(p is not None and not p.unbiased for p in c.parts)
    assert any(isinstance(c, Derived) and c.unbiased for c in lossy)  # the norms' outputs
