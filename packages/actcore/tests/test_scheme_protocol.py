"""A converted layer's ``act_scheme`` is a :class:`actcore.extend.Scheme`: the two bits
schemes implement it, and a scheme of one's own is asked for each saved tensor's
compressor and handed each output gradient."""

from __future__ import annotations

import torch
from torch import nn

import actcore
from actcore.extend import QLayer, Quantize, Scheme, config


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def test_the_adaptive_bits_and_the_policies_are_schemes():
    adaptive = actcore.convert(_net(), level="L3").act_adaptive
    policy = actcore.convert(_net(), level="L2", policy="auto").act_policy
    assert isinstance(adaptive, Scheme) and isinstance(policy, Scheme)
    assert not isinstance(object(), Scheme)


class EightBits:
    """Every saved tensor at 8 bits; counts what it is asked and handed."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.observed: list[str] = []

    def compressor(self, layer, role, x, bits, mask):
        self.asked.append((layer.act_name, role))
        return Quantize(8, config.group_size, per_sample=False)

    def observe(self, layer, grad, kernel, channel_dim, norm, restored=None):
        self.observed.append(layer.act_name)


def test_a_scheme_of_ones_own_chooses_the_compressor_and_sees_the_gradients():
    x = torch.randn(2, 3, 8, 8)
    model = actcore.convert(_net(), level="L2")
    scheme = EightBits()
    assert isinstance(scheme, Scheme)
    for m in model.modules():
        if isinstance(m, QLayer):
            m.act_scheme = scheme
    model(x).sum().backward()
    # (the first convolution keeps the model's input as it is: the caller holds it anyway)
    assert {name for name, _ in scheme.asked} == {"2", "4"}
    assert set(scheme.observed) == {"0", "2", "4"}
    plain = actcore.convert(_net(), level="L2")
    kept = {}
    for key, net in (("eight", model), ("level", plain)):
        with actcore.memory.track(net) as report:
            out = net(x)
        del out
        kept[key] = report.retained_bytes
    assert kept["eight"] > kept["level"]  # 8 bits keep more than the level's own bits
