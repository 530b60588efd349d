"""Q-layers inside ``torch.utils.checkpoint`` (non-reentrant): they compose.

Inside a checkpointed region checkpoint's own saved-tensor hooks take every tensor the
Q-layers save (packed or not) and recompute it in backward, so the region keeps nothing; the
Q-layers' compression applies to what is outside the region.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import flat, forward_backward, grad_cosine
from torch import nn
from torch.utils.checkpoint import checkpoint

import actcore
from actcore import memory


class _Net(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=False) if self.use_checkpoint else self.block(h)
        return self.head(h)


def _net(use_checkpoint: bool, level: str | None) -> nn.Module:
    torch.manual_seed(0)
    net = _Net(use_checkpoint)
    return net if level is None else actcore.convert(net, level=level)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return forward_backward(model, x, mean=True)


X = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_l0_under_checkpoint_bitwise_equal_to_no_checkpoint() -> None:
    out_ref, g_ref = _step(_net(False, None), X)
    for use_ckpt in (False, True):
        out, g = _step(_net(use_ckpt, "L0"), X)
        assert torch.equal(out, out_ref)
        for a, b in zip(g_ref, g, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_compressed_under_checkpoint_finite_and_close(level: str) -> None:
    _, g_ref = _step(_net(False, None), X)
    out, g = _step(_net(True, level), X)
    assert torch.equal(out, _net(False, None)(X).detach())  # forward unchanged
    flat_ref, flat_g = flat(g_ref), flat(g)
    assert torch.isfinite(flat_g).all()
    rel = ((flat_g - flat_ref).norm() / flat_ref.norm()).item()
    # only the stem's saved tensors are quantized (at 2-4 bits): a modest relative error
    assert rel < 0.5, rel
    cos = grad_cosine(g, g_ref)
    assert cos > 0.9, cos


def test_retained_bytes_checkpoint_plus_l3_at_most_checkpoint_alone() -> None:
    """Checkpoint wins inside its region; what it keeps, the region's input (here
    8 x 16 x 16 x 16 fp32), goes through convert's hooks and is compressed too, as is
    everything outside the region. With ``layers_only`` the region's input stays fp32."""
    held = {}
    for label, model in {
        "plain": _net(False, None),
        "checkpoint": _net(True, None),
        "checkpoint + L3": _net(True, "L3"),
        "L3": _net(False, "L3"),
    }.items():
        with memory.track(model) as rep:
            out = model(X)
        held[label] = rep.retained_bytes
        out.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert held["checkpoint"] < held["plain"]
    assert held["checkpoint + L3"] <= held["checkpoint"]
    region_input = 8 * 16 * 16 * 16 * 4
    assert held["checkpoint + L3"] < region_input // 4 < held["checkpoint"] // 4
    layers_only = actcore.convert(_net(True, None), level="L3", layers_only=True)
    with memory.track(layers_only) as rep:
        out = layers_only(X)
    assert region_input <= rep.retained_bytes < held["checkpoint"] - region_input // 2
    out.sum().backward()
    print(held)  # e.g. plain 811904, checkpoint 287360, checkpoint + L3 154400, L3 49796


def test_second_backward_through_checkpointed_q_layers() -> None:
    model = _net(True, "L0")
    ref = copy.deepcopy(model)
    out = model(X).square().mean()
    out.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out.backward()
    for a, b in zip(first, (p.grad for p in model.parameters()), strict=True):
        assert torch.equal(a, b)
    _, g_ref = _step(ref, X)
    for a, b in zip(first, g_ref, strict=True):
        assert torch.equal(a, b)


def test_functional_blocks_under_checkpoint_compress_what_checkpoint_keeps() -> None:
    """Blocks written with functionals (sdpa, rms_norm, silu, products) checkpointed one by
    one: the scope leaves the ops inside the region plain (the recomputation in backward
    must save the same tensors) and compresses the block inputs checkpoint keeps."""
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d: int = 64) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            h = F.rms_norm(x, (d,))
            q, k, v = self.qkv(h).view(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            gate, up = self.up(F.rms_norm(x, (d,))).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    plain = Net()
    x = torch.randn(4, 64, 64)
    model = actcore.convert(copy.deepcopy(plain), "L3")
    out = plain(x)
    out.square().mean().backward()
    with memory.track(plain) as rep:
        held = plain(x)
    ckpt_bytes = rep.retained_bytes
    conv_out = model(x)
    assert torch.equal(conv_out, out)
    conv_out.square().mean().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.95, cos
    with memory.track(model) as rep:
        held = model(x)  # noqa: F841
    assert rep.retained_bytes * 4 <= ckpt_bytes  # the block inputs at 4 bits, not 32
