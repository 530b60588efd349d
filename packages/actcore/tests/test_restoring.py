"""A packing with several readers in backward is restored once (compressors/restoring.py):
the gradients are bitwise those of restoring it for each reader, the repeats are gone, and
nothing restored outlives the backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.bench.gpt import CharGPT, GPTConfig
from actcore.compressors import Derived, Packing, Quantize, restoring
from actcore.ops.seeds import reset_seed_stream


class RMSNorm(nn.Module):
    """A norm written in Python, as transformers writes its ``*RMSNorm`` (recomputed)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaBlock(nn.Module):
    """q, k and v read one normed input, gate and up another; a SwiGLU product."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (
            f(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _llama() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(LlamaBlock(), LlamaBlock())
    x = torch.randn(2, 48, 64)
    return model, lambda m: m(x).square().mean()


def _gpt() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = CharGPT(GPTConfig(vocab_size=40, context=32, layers=2, heads=2, width=64))
    ids = torch.randint(0, 40, (3, 33))
    return model, lambda m: m(ids[:, :-1], ids[:, 1:])


MODELS = {"llama_block": _llama, "char_gpt": _gpt}


def _unpacks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the restorations of Quantize packings (``unpack``, and ``unpack_scaled``
    under ChannelScaled) and of Derived ones."""
    counts = {"quantize": 0, "derived": 0}
    for cls, method, name in (
        (Quantize, "unpack", "quantize"),
        (Quantize, "unpack_scaled", "quantize"),
        (Derived, "unpack", "derived"),
    ):
        original = getattr(cls, method)

        def unpack(self, *args, _original=original, _name=name):
            counts[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, method, unpack)
    return counts


def _grads(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_of(model).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_packing_is_restored_once_with_the_same_gradients(
    name: str, monkeypatch: pytest.MonkeyPatch, small_tensors: None
) -> None:
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    actcore.convert(model)  # the default level
    twin = copy.deepcopy(model)
    counts = _unpacks(monkeypatch)
    shared = _grads(model, loss_of)
    once = dict(counts)
    assert restoring.pending() == 0  # nothing restored outlives the backward

    monkeypatch.setattr(restoring, "expect", lambda packing: None)  # every read unpacks
    counts.update(quantize=0, derived=0)
    each = _grads(twin, loss_of)
    assert all(torch.equal(a, b) for a, b in zip(shared, each, strict=True))
    assert once["quantize"] < counts["quantize"]  # the repeats were there, and are gone
    if name == "llama_block":
        assert once["derived"] < counts["derived"]


def test_hooks_route_shares_a_tensor_two_ops_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w1, w2 = (torch.randn(256, 256, requires_grad=True) for _ in range(2))

    def grads() -> list[torch.Tensor]:
        for t in (x, w1, w2):
            t.grad = None
        reset_seed_stream()  # the same rounding noise in both runs
        with actcore.compress_saved_tensors("G1"):
            h = torch.tanh(x)
            loss = ((h @ w1).square() + (h @ w2).square()).sum()
        loss.backward()
        return [t.grad.clone() for t in (x, w1, w2)]

    counts = _unpacks(monkeypatch)
    shared = grads()
    once = counts["quantize"]
    assert restoring.pending() == 0
    monkeypatch.setattr(restoring, "expect", lambda packing: None)
    counts["quantize"] = 0
    each = grads()
    assert all(torch.equal(a, b) for a, b in zip(shared, each, strict=True))
    assert once < counts["quantize"]


def test_a_reader_that_changed_the_tensor_gets_a_fresh_one(small_tensors: None) -> None:
    x = torch.randn(8, 64)
    comp = Quantize(4, 256)
    tensors, meta = comp.pack(x)
    packing = Packing(comp, tuple(tensors), meta)
    for _ in range(3):
        restoring.expect(packing)
    with torch.no_grad():
        first = restoring.restore(comp, tensors, meta)
        expected = first.clone()
        first.zero_()  # a reader that works in place on what it got
        second = restoring.restore(comp, tensors, meta)
        assert second is not first and torch.equal(second, expected)
        assert restoring.restore(comp, tensors, meta) is second  # (the last read)
    assert restoring.pending() == 0


def test_an_unread_expectation_dies_with_the_packing() -> None:
    comp = Quantize(4, 256)
    tensors, meta = comp.pack(torch.randn(8, 64))
    packing = Packing(comp, tuple(tensors), meta)
    restoring.expect(packing)
    restoring.expect(packing)
    with torch.no_grad():
        restoring.restore(comp, tensors, meta)  # one read of two: held for the other
    assert restoring.pending() == 1
    del packing, tensors
    assert restoring.pending() == 0


def test_entries_need_no_collector() -> None:
    """The table's entries and what they restore are freed by reference counting when a step
    ends: no reference cycle leaves them to Python's cyclic collector (whose full passes
    over every object in the process cost a small model's step several percent)."""
    import gc

    model = actcore.convert(LlamaBlock(), "L3")
    x = torch.randn(2, 16, 64)
    model(x).square().sum().backward()  # (warm)
    gc.collect()
    gc.disable()
    try:
        model(x).square().sum().backward()
        left = [o for o in gc.get_objects() if isinstance(o, restoring._Entry)]
    finally:
        gc.enable()
    assert not left and not restoring.pending(), left
