"""Bias of compressed gradients on a torchvision classifier or a tiny Llama: the mean of n.

Usage: ``python benchmarks/gradient_bias.py efficientnet_b0 --level L3 --steps 64``
(``llama``: a 2-layer Llama, hidden 128, 128 random tokens, converted by ``act_hf.convert``
with the model's sdpa attention kept; needs act-hf)

Batch 4, 64x64 random images, random labels, dropout and stochastic depth off, batch-norm
momentum 0, so every step sees the same exact gradient. Prints the relative error of the
mean of n compressed gradients (n = 1, 4, 16, steps) and its ratio to
``rms(single-step error) / sqrt(steps)``: about 1 when the gradient is unbiased, growing
with ``steps`` when it is not (the issue "Unbiased gradients" asks for at most 1.5). Also
ActNN's gradient-variance ratio: the compression's variance on that batch over the
minibatch variance of 8 fresh batches of the same size (below 1: the noise compression
adds is smaller than SGD's own).
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
    if y.dim() == 2:  # a language model's labels
        model(input_ids=x, labels=y).loss.backward()
    else:
        F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _llama(level: str) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import act_hf

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).train()
    x = torch.randint(0, 256, (4, 128))
    return model, act_hf.convert(copy.deepcopy(model), level), x, x.clone()


SGD_BATCHES = 8
"""Fresh batches (same size, same distribution) whose exact gradients give the minibatch
variance that the compression variance is compared with (ActNN's gradient-variance ratio)."""


def measure(name: str, level: str, steps: int) -> dict:
    torch.manual_seed(0)
    if name == "llama":
        model, converted, x, y = _llama(level)
        batches = [(t, t.clone()) for t in torch.randint(0, 256, (SGD_BATCHES, *x.shape))]
        return _errors(name, level, steps, model, converted, x, y, batches)
    kwargs = {"image_size": 64} if name.startswith("vit") else {}
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = 0.0
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    converted = actcore.convert(copy.deepcopy(model), level=level)
    batches = [(torch.randn_like(x), torch.randint(0, 10, (4,))) for _ in range(SGD_BATCHES)]
    return _errors(name, level, steps, model, converted, x, y, batches)


def _errors(
    name: str,
    level: str,
    steps: int,
    model: nn.Module,
    converted: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict:
    plain = copy.deepcopy(model)
    exact = _flat_grad(plain, x, y)
    sgd = torch.stack([_flat_grad(plain, bx, by) for bx, by in batches])
    sgd_variance = float(sgd.var(0, correction=1).sum())  # E|g_batch - E g|^2
    total, square, errors, spread = torch.zeros_like(exact), 0.0, {}, 0.0
    for n in range(1, steps + 1):
        g = _flat_grad(converted, x, y)
        total += g
        square += float((g - exact).norm() / exact.norm()) ** 2
        spread += float((g - exact).square().sum())
        if n in (1, 4, 16, steps):
            errors[n] = float((total / n - exact).norm() / exact.norm())
    projection = math.sqrt(square / steps) / math.sqrt(steps)
    return {
        "model": name,
        "level": level,
        "error_of_mean": errors,
        "projection": projection,
        "ratio": errors[steps] / projection,
        # ActNN's gradient-variance ratio: compression's E|g_c - g|^2 on one batch over the
        # minibatch variance E|g_b - E g|^2 of batches of the same size
        "compression_variance": spread / steps,
        "sgd_variance": sgd_variance,
        "variance_ratio": spread / steps / sgd_variance,
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
