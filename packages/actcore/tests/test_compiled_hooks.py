"""The hooks route inside torch.compile: pack and unpack inlined into the compiled graphs
(:mod:`actcore.saved_tensors.compiled`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.memory import profiled_bytes
from actcore.saved_tensors import compiled

pytestmark = pytest.mark.skipif(
    not compiled.inlining_supported(), reason="this torch does not inline saved-tensor hooks"
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.GELU(),
        nn.LayerNorm(512),
        nn.Linear(512, 10),
    )


class Block(nn.Module):
    """A pre-norm transformer block as people write it: sdpa, GELU MLP, a softmax over a
    product, a cross-entropy head."""

    def __init__(self, d: int = 64, heads: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.out(F.gelu(self.fc(x)))
        mixed = torch.softmax(x @ x.transpose(1, 2), -1) @ x
        logits = self.head(mixed)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def mlp_pair() -> tuple[Any, ...]:
    model = _mlp()
    plain = copy.deepcopy(model)
    return (
        model,
        plain,
        torch.compile(model, fullgraph=True),
        torch.compile(plain, fullgraph=True),
    )


X = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(2))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _step(model: nn.Module, compiled_model: Any, level: str | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if level is None:
        loss = F.cross_entropy(compiled_model(X), Y)
    else:
        with actcore.compress_saved_tensors(level, min_numel=256):
            loss = F.cross_entropy(compiled_model(X), Y)
    loss.backward()
    return _grads(model)


def test_forward_is_bitwise_and_keeps_fewer_bytes(mlp_pair: tuple[Any, ...]) -> None:
    _model, _plain, cm, cp = mlp_pair
    ref = cp(X)
    with actcore.compress_saved_tensors("L1.2", min_numel=256):
        out = cm(X)
    assert torch.equal(out, ref)
    _, plain_bytes = profiled_bytes(lambda: cp(X))
    with actcore.compress_saved_tensors("L1.2", min_numel=256):
        _, act_bytes = profiled_bytes(lambda: cm(X))
    # ReLU output at 2 bits + its 1-bit mask, GELU input at 4, the rest at 2 (plus group
    # metadata): 9.2x measured against fp32
    assert plain_bytes / act_bytes >= 6, (plain_bytes, act_bytes)


def test_gradients_are_unbiased(mlp_pair: tuple[Any, ...]) -> None:
    """The mean of N compressed gradients tends to the exact one as 1/sqrt(N) (fresh
    stochastic rounding per step): after 64 steps its error is at most 1/4 of one step's
    (theory 1/8)."""
    model, plain, cm, cp = mlp_pair
    exact = _step(plain, cp, None)
    torch.manual_seed(3)
    steps = 64
    first = _step(model, cm, "L1.2")
    total = [g.clone() for g in first]
    for _ in range(steps - 1):
        for t, g in zip(total, _step(model, cm, "L1.2"), strict=True):
            t += g
    for one, tot, ref in zip(first, total, exact, strict=True):
        err_one = (one - ref).norm() / ref.norm()
        err_mean = (tot / steps - ref).norm() / ref.norm()
        assert err_mean <= 0.25 * err_one + 1e-6, (err_one.item(), err_mean.item())
    assert max((a - b).norm() / b.norm() for a, b in zip(first, exact, strict=True)) > 0.05


def test_fresh_rounding_every_step_without_recompiling(mlp_pair: tuple[Any, ...]) -> None:
    model, _plain, cm, _cp = mlp_pair
    _step(model, cm, "L1.2")  # compiled (or reused) for this level
    with torch.compiler.set_stance("fail_on_recompile"):
        a = _step(model, cm, "L1.2")
        b = _step(model, cm, "L1.2")
        c = _step(model, cm, "L1.2")
    assert any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(b, c, strict=True))


def test_level_zero_is_the_compiled_plain_model(mlp_pair: tuple[Any, ...]) -> None:
    model, plain, cm, cp = mlp_pair
    exact = _step(plain, cp, None)
    for got, ref in zip(_step(model, cm, "L0"), exact, strict=True):
        assert torch.equal(got, ref)


def test_bf16_autocast_restores_dtypes(mlp_pair: tuple[Any, ...]) -> None:
    model, _plain, cm, cp = mlp_pair
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cp(X)
        with actcore.compress_saved_tensors("L1", min_numel=256):
            out = cm(X)
        assert torch.equal(out, ref) and out.dtype == torch.bfloat16
        loss = F.cross_entropy(out.float(), Y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == p.dtype for p in model.parameters())


def _recorded_treatments(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, Any]]:
    seen: list[tuple[str, tuple, Any]] = []
    original = compiled.treatment

    def record(x: torch.Tensor, policy: Any, context: Any) -> Any:
        how = original(x, policy, context)
        if context is not None:
            seen.append((context["_node"].name, tuple(x.shape), how))
        return how

    monkeypatch.setattr(compiled, "treatment", record)
    return seen


def test_transformer_block_treatments(monkeypatch: pytest.MonkeyPatch) -> None:
    """q and k of sdpa's backward, its output and logsumexp, the logits and the norm
    statistics stay exact; v and the products' inputs take the level's bits; the GELU's
    input and the softmax output at least 4."""
    seen = _recorded_treatments(monkeypatch)
    torch.manual_seed(0)
    block = Block()
    plain = copy.deepcopy(block)
    x = torch.randn(4, 48, 64)
    y = torch.randint(0, 50, (4, 48))
    cb = torch.compile(block, fullgraph=True)
    with actcore.compress_saved_tensors("L1.2", min_numel=256):
        loss = cb(x, y)
    ref = torch.compile(plain, fullgraph=True)(x, y)
    assert torch.equal(loss, ref)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())
    why = {w.why for _, _, w in seen}
    assert "q or k of an attention backward" in why
    assert "a softmax's input (logits)" in why
    assert any(w.why.startswith("made by aten._scaled_dot_product") for _, _, w in seen)
    by_node = {name: (shape, w) for name, shape, w in seen}  # (each node is traced twice)
    heads = [w for shape, w in by_node.values() if shape == (4, 4, 48, 16)]
    kept = [w for w in heads if w.kind == "keep"]
    quantized = [w for w in heads if w.kind == "quantize"]
    assert len(kept) == 3 and len(quantized) == 1 and quantized[0].bits == 2  # q, k, out / v
    for _, shape, w in seen:
        if w.kind != "keep":
            assert w.bits >= (2 if w.why == "read by products only" else 4)
        if shape in ((192, 256), (4, 48, 48)) and w.why == "read nonlinearly":
            assert w.bits == 4  # the GELU's input, the softmax's output


def test_dynamic_sequence_lengths_share_one_graph() -> None:
    torch.manual_seed(0)
    block = Block()
    cb = torch.compile(block, fullgraph=True, dynamic=True)

    def step(t: int) -> torch.Tensor:
        x = torch.randn(2, t, 64)
        y = torch.randint(0, 50, (2, t))
        with actcore.compress_saved_tensors("L1.2", min_numel=256):
            loss = cb(x, y)
        loss.backward()
        return loss

    step(32)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in (48, 40, 64):
            assert torch.isfinite(step(t))
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())
