"""Bias of compressed gradients on a torchvision classifier: the mean of n of them.

Usage: ``python benchmarks/gradient_bias.py efficientnet_b0 --level L3 --steps 64``

Batch 4, 64x64 random images, random labels, dropout and stochastic depth off, batch-norm
momentum 0, so every step sees the same exact gradient. Prints the relative error of the
mean of n compressed gradients (n = 1, 4, 16, steps) and its ratio to
``rms(single-step error) / sqrt(steps)``: about 1 when the gradient is unbiased, growing
with ``steps`` when it is not (the issue "Unbiased gradients" asks for at most 1.5).
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import actcore


def _flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def measure(name: str, level: str, steps: int) -> dict:
    torch.manual_seed(0)
    kwargs = {"image_size": 64} if name.startswith("vit") else {}
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = 0.0
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    exact = _flat_grad(copy.deepcopy(model), x, y)
    converted = actcore.convert(copy.deepcopy(model), level=level)
    total, square, errors = torch.zeros_like(exact), 0.0, {}
    for n in range(1, steps + 1):
        g = _flat_grad(converted, x, y)
        total += g
        square += float((g - exact).norm() / exact.norm()) ** 2
        if n in (1, 4, 16, steps):
            errors[n] = float((total / n - exact).norm() / exact.norm())
    projection = math.sqrt(square / steps) / math.sqrt(steps)
    return {
        "model": name,
        "level": level,
        "error_of_mean": errors,
        "projection": projection,
        "ratio": errors[steps] / projection,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--level", default="L3")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.level, args.steps), indent=1))


if __name__ == "__main__":
    main()
