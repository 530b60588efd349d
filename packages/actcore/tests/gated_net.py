"""A small net whose blocks save tensors through functional ops (what a converted model's
scope compresses), for the scope and memory-plan tests."""

from __future__ import annotations

import torch
from torch import nn


class Gated(nn.Module):
    """``x + down(tanh(a) * sigmoid(b))`` with ``a, b`` from ``up(x)``: the products and
    activations save through the scope."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).chunk(2, dim=-1)
        return x + self.down(torch.tanh(a) * torch.sigmoid(b))
