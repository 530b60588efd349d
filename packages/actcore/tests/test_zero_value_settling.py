"""Zero-value packing without a host read: the padded buffers and their cut (the path CUDA
takes, forced here on CPU): the same gradients bit for bit at every level that keeps ReLU
outputs as nonzeros, the payloads cut to their exact size in place, nothing left waiting
after backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore import ops
from actcore.compressors import Quantize, ZeroValue
from actcore.compressors import zero_value as zv


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 12 * 12, 5),
    )


def _grads(model: nn.Module, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def padded(monkeypatch):
    """Every zero-value pack takes the padded path, as on CUDA; returns the packs made."""
    made: list[tuple[torch.Tensor, ...]] = []
    real = ops.masked_quantize_padded

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(out[:3])
        return out

    monkeypatch.setattr(zv, "_pads", lambda x: True)
    monkeypatch.setattr(zv.ops, "masked_quantize_padded", spy)
    yield made
    zv.settle()


def test_padded_buffers_decode_and_are_cut_to_their_exact_size(padded):
    x = torch.relu(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)))
    mask = ops.pack_mask(x != 0)
    compressor = ZeroValue(mask, Quantize(2, group_size=64, per_sample=False))
    tensors, meta = compressor.pack(x)
    assert tensors[1].shape == (1, (1500 + 7) // 8 * 2)  # sized for every element
    assert zv.unsettled() == 1
    before = ops.masked_dequantize(*tensors[1:], mask, 2, 64, x.shape, x.dtype)
    count = int((x != 0).sum())
    assert zv.settle() == 0
    assert tensors[1].shape == (1, (count + 7) // 8 * 2)  # the payload, cut in place
    assert tensors[2].shape == tensors[3].shape == (1, -(-1500 // 64))  # lo, step: not cut
    back = compressor.unpack(tensors, meta)
    assert torch.equal(back, before)
    assert torch.equal(back == 0, x == 0)


@pytest.mark.parametrize("level", ["L3", "L3.1", "L4"])
def test_layer_route_gradients_are_the_same_padded_or_not(level, monkeypatch):
    expected = _grads(actcore.convert(_net(), level=level))
    made: list = []
    real = ops.masked_quantize_padded
    monkeypatch.setattr(zv, "_pads", lambda x: True)
    monkeypatch.setattr(
        zv.ops, "masked_quantize_padded", lambda *a, **k: made.append(1) or real(*a, **k)
    )
    got = _grads(actcore.convert(_net(), level=level))
    assert made, "the zero-value packs did not take the padded path"
    assert zv.unsettled() == 0  # each unpack in backward cut what was waiting
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_buffers_saved_by_autograd_are_cut_without_a_version_error(padded):
    """The layer route saves the buffers with ctx.save_for_backward: the cut (set_ on the
    same tensor) keeps their version, so backward reads them, and they are the cut ones."""
    model = actcore.convert(_net(), level="L3")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
    loss = F.cross_entropy(model(x), y)
    assert padded and zv.unsettled() >= 1
    assert zv.settle() == 0
    full = (4 * 8 * 12 * 12 + 7) // 8 * 2
    assert all(p.shape[1] < full for p, *_ in padded)  # about half the values are zeros
    loss.backward()  # a version error would raise here
    assert all(p.grad is not None for p in model.parameters())


def test_a_dropped_packing_is_forgotten(padded):
    x = torch.relu(torch.randn(700, generator=torch.Generator().manual_seed(4)))
    compressor = ZeroValue(ops.pack_mask(x != 0), Quantize(4, per_sample=False))
    tensors, _ = compressor.pack(x)
    del tensors
    assert zv.unsettled() == 1
    assert zv.settle() == 0


def test_the_tracker_counts_the_cut_payloads(monkeypatch):
    """ACT's own accounting follows the cut: the storage it counts is the exact one."""
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(6))

    def kept(padded: bool) -> int:
        model = actcore.convert(_net(), level="L3")
        with monkeypatch.context() as m:
            if padded:
                m.setattr(zv, "_pads", lambda t: True)
            with actcore.memory.track(model) as report:
                out = model(x)
                zv.settle()
        del out
        return report.retained_bytes

    exact, padded = kept(False), kept(True)
    # the two zero-value inputs (of the 2nd and 3rd convs, 4 x 8 x 12 x 12 each) keep their
    # lo and step (2 + 2 bytes per group of 256) sized for every element: at most this more
    uncut = 2 * 4 * math.ceil(4 * 8 * 12 * 12 / 256)
    assert 0 <= padded - exact <= uncut  # (the uncut payloads would be ~600 bytes more)
