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
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
        out = cm(X)
    assert torch.equal(out, ref)
    _, plain_bytes = profiled_bytes(lambda: cp(X))
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
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
    first = _step(model, cm, "G1.2")
    total = [g.clone() for g in first]
    for _ in range(steps - 1):
        for t, g in zip(total, _step(model, cm, "G1.2"), strict=True):
            t += g
    for one, tot, ref in zip(first, total, exact, strict=True):
        err_one = (one - ref).norm() / ref.norm()
        err_mean = (tot / steps - ref).norm() / ref.norm()
        assert err_mean <= 0.25 * err_one + 1e-6, (err_one.item(), err_mean.item())
    assert max((a - b).norm() / b.norm() for a, b in zip(first, exact, strict=True)) > 0.05


def test_fresh_rounding_every_step_without_recompiling(mlp_pair: tuple[Any, ...]) -> None:
    model, _plain, cm, _cp = mlp_pair
    _step(model, cm, "G1.2")  # compiled (or reused) for this level
    with torch.compiler.set_stance("fail_on_recompile"):
        a = _step(model, cm, "G1.2")
        b = _step(model, cm, "G1.2")
        c = _step(model, cm, "G1.2")
    assert any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(b, c, strict=True))


def test_level_zero_is_the_compiled_plain_model(mlp_pair: tuple[Any, ...]) -> None:
    model, plain, cm, cp = mlp_pair
    exact = _step(plain, cp, None)
    for got, ref in zip(_step(model, cm, "G0"), exact, strict=True):
        assert torch.equal(got, ref)


def test_bf16_autocast_restores_dtypes(mlp_pair: tuple[Any, ...]) -> None:
    model, _plain, cm, cp = mlp_pair
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cp(X)
        with actcore.compress_saved_tensors("G1", min_numel=256):
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
    """Attention is recomputed in backward from its packed q, k (4 bits at least, the
    largest head feature exact) and v (the level's bits); the norm statistics stay exact, the
    cross-entropy's logits, which backward reads through exp, are kept as exp(x - rowmax); the
    products' inputs take the level's bits, the GELU's input and the softmax output at least
    4; the gradients stay close to the plain compiled model's."""
    seen = _recorded_treatments(monkeypatch)
    torch.manual_seed(0)
    block = Block()
    plain, eager = copy.deepcopy(block), copy.deepcopy(block)
    x = torch.randn(4, 48, 64)
    y = torch.randint(0, 50, (4, 48))
    cb = torch.compile(block, fullgraph=True)
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
        loss = cb(x, y)
        eager(x, y).backward()  # the eager hooks route, for comparison
    ref = torch.compile(plain, fullgraph=True)(x, y)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    exact = torch.cat([p.grad.flatten() for p in plain.parameters()])

    def cosine(model: nn.Module) -> float:
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        return F.cosine_similarity(got, exact, 0).item()

    # 2 bits on a tiny block: 0.81 compiled, 0.83-0.85 eager (0.99 both at 4 bits)
    assert cosine(block) > 0.9 * cosine(eager)
    by_node = {name: (shape, w) for name, shape, w in seen}  # (each node is traced twice)
    why = {w.why for _, w in by_node.values()}
    assert "q or k of an attention backward" not in why
    logits = [w for shape, w in by_node.values() if w.why == "read through exp in backward"]
    assert logits and all(w.kind == "exp" and w.bits == 4 for w in logits), by_node
    assert {s for s, w in by_node.values() if w in logits} <= {(4, 48, 50), (192, 50)}
    heads = [w for shape, w in by_node.values() if shape == (4, 4, 48, 16)]
    qk = [w for w in heads if w.why == "q or k of a recomputed attention"]
    assert len(qk) == 2 and all(w.bits == 4 and w.exact_features == 1 for w in qk)
    assert [w.bits for w in heads if w not in qk] == [2]  # v
    for shape, w in by_node.values():
        if w.kind != "keep":
            assert w.bits >= (2 if w.why == "read by products only" else 4)
        if shape in ((192, 256), (4, 48, 48)) and w.why == "read nonlinearly":
            assert w.bits == 4  # the GELU's input, the softmax's output


def test_attention_with_an_outlier_feature() -> None:
    """One head feature of q and k 200x the others (as in large language models): with that
    feature exact the gradients stay close at 4 bits (0.04-0.16 relative error; quantized
    with the rest it was 2 to 56)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 64, 32)
    weights = [torch.randn(32, 32) / 32**0.5 for _ in range(3)]
    weights[0][:, 3] *= 200
    weights[1][:, 3] *= 200

    def f(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(x @ wq, x @ wk, x @ wv, is_causal=True)
        return out.square().sum()

    inputs = [t.clone().requires_grad_() for t in (x, *weights)]
    f(*inputs).backward()
    exact = [t.grad for t in inputs]
    inputs = [t.clone().requires_grad_() for t in (x, *weights)]
    with actcore.compress_saved_tensors("G1", min_numel=256):
        loss = torch.compile(f, fullgraph=True)(*inputs)
    loss.backward()
    for t, ref in zip(inputs, exact, strict=True):
        assert torch.isfinite(t.grad).all()
        assert (t.grad - ref).norm() / ref.norm() < 0.3


def test_dynamic_sequence_lengths_share_one_graph() -> None:
    torch.manual_seed(0)
    block = Block()
    cb = torch.compile(block, fullgraph=True, dynamic=True)

    def step(t: int) -> torch.Tensor:
        x = torch.randn(2, t, 64)
        y = torch.randint(0, 50, (2, t))
        with actcore.compress_saved_tensors("G1.2", min_numel=256):
            loss = cb(x, y)
        loss.backward()
        return loss

    step(32)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in (48, 40, 64):
            assert torch.isfinite(step(t))
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def test_rounding_leaves_torch_generator_alone(mlp_pair: tuple[Any, ...]) -> None:
    """The noise comes from actcore's own seeds (``actcore::quantize_fresh``): a compiled
    step with the hooks leaves torch's generator where it found it, so dropout and other
    random ops see the stream they would see without actcore."""
    model, _, cm, _ = mlp_pair
    _step(model, cm, "G1.2")  # compiled
    state = torch.get_rng_state()
    _step(model, cm, "G1.2")
    assert torch.equal(torch.get_rng_state(), state)


def test_quantize_fresh_rounds_with_a_new_seed_each_call() -> None:
    """``actcore::quantize_fresh`` is ``quantize`` under a seed drawn per call: two calls on
    one tensor differ, and each is unbiased and within one step of the tensor."""
    torch.manual_seed(0)
    x = torch.randn(3, 512)
    calls = [actcore.ops.seeds.quantize_fresh(x, 2, 256, False) for _ in range(64)]
    assert not torch.equal(calls[0][0], calls[1][0])
    back = [
        actcore.ops.dequantize(actcore.ops.Packed(*c, x.shape, x.dtype, 2, 256, False))
        for c in calls
    ]
    step = calls[0][2].float().repeat_interleave(256, 1).view(3, 512)
    assert ((back[0] - x).abs() <= step * 1.0001).all()
    # 64 draws, each error bounded by a step and zero mean: the mean error of every element
    # within 5 standard deviations (step / sqrt(4 * 64)) of zero
    mean_error = (torch.stack(back).mean(0) - x).abs()
    assert (mean_error <= 5 * step / (4 * 64) ** 0.5).all()


def test_eager_saves_go_to_their_own_thread_hooks() -> None:
    """Two threads inside their own blocks at once (G0 and G1.2): each eager save is packed
    by its own thread's hooks (the pushed graphs are shared, their owners per thread)."""
    import threading

    barrier = threading.Barrier(2)
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(64, 512)
    grads: dict[str, torch.Tensor] = {}

    def run(level: str) -> None:
        with actcore.compress_saved_tensors(level, min_numel=256):
            barrier.wait()  # both blocks are active now
            h = torch.tanh(x @ w)  # saves x and tanh's output
            barrier.wait()
        (g,) = torch.autograd.grad(h.sum(), w)
        grads[level] = g

    threads = [threading.Thread(target=run, args=(lv,)) for lv in ("G0", "G1.2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (exact,) = torch.autograd.grad(torch.tanh(x @ w).sum(), w)
    assert torch.equal(grads["G0"], exact)
    assert not torch.equal(grads["G1.2"], exact)


def test_attention_mask_with_minus_infinity_stays_exact() -> None:
    """A float attention mask made in the graph (-inf above the diagonal, as Hugging Face's
    sdpa path passes it) is kept exact: quantized, its -inf made every gradient NaN."""
    torch.manual_seed(0)
    proj = nn.Linear(32, 96)

    def f(x: torch.Tensor) -> torch.Tensor:
        q, k, v = proj(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = torch.full((64, 64), float("-inf")).triu(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.square().sum()

    x = torch.randn(2, 64, 32)
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
        loss = torch.compile(f, fullgraph=True)(x)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in proj.parameters())


def test_enclosing_hooks_are_warned_of_what_compiled_graphs_keep() -> None:
    """A user's saved-tensor hooks around the block receive the packings of eager saves
    (their gradients correct); what a compiled graph saves stays inside it, out of their
    reach: a warning says so, once per block."""
    import warnings

    seen: list[torch.dtype] = []
    user = torch.autograd.graph.saved_tensors_hooks(
        lambda t: seen.append(t.dtype) or t, lambda t: t
    )
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    fn = torch.compile(lambda a, b: torch.tanh(a @ b), fullgraph=True)
    hooks = actcore.compress_saved_tensors("G2", min_numel=256)
    with user, pytest.warns(UserWarning, match="compiled by torch.compile"), hooks:
        h = fn(x, w)
        eager = torch.tanh(x @ w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with user, hooks:
            fn(x, w)  # the graph is cached: no second warning
    assert torch.uint8 in seen  # the eager tanh's packed output went on to the user's hooks
    (g,) = torch.autograd.grad((h + eager).sum(), w)
    (exact,) = torch.autograd.grad(2 * torch.tanh(x @ w).sum(), w)
    assert torch.nn.functional.cosine_similarity(g.flatten(), exact.flatten(), 0) > 0.95


def test_an_eager_hook_call_is_the_pack_function_itself() -> None:
    """Called eagerly, a pack / unpack graph calls its function directly: GraphModule's own
    __call__ (the generated forward behind a traceback wrapper) is not in the way."""
    from actcore.saved_tensors.compiled import SavedHooksGraph, graph_hooks
    from actcore.saved_tensors.graph_treatment import GraphPolicy

    for hook in graph_hooks(GraphPolicy(bits=4)):
        assert type(hook).__call__ is SavedHooksGraph.__call__
    with actcore.compress_saved_tensors("G1.2", min_numel=0):
        w = torch.randn(16, 16, requires_grad=True)
        y = torch.tanh(torch.randn(4, 16) @ w)
    y.sum().backward()
    assert w.grad is not None and w.grad.isfinite().all()


def test_a_float_mask_is_kept_at_one_bit_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float attention mask made as ``where(condition, 0, -inf)`` (Hugging Face's sdpa mask
    under torch.compile) is kept as its condition, 1 bit an element, and restored exactly:
    with it the only tensor large enough to pack, the gradients are the compiled plain
    ones bit for bit."""
    seen = _recorded_treatments(monkeypatch)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(64, 64, dtype=torch.bool).tril()
        mask = torch.where(keep, 0.0, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()

    exact = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    torch._dynamo.reset()
    with actcore.compress_saved_tensors("G1.2", min_numel=2048):
        loss = torch.compile(f, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    masks = [how for _, shape, how in seen if shape == (64, 64)]
    assert masks and all(how.kind == "select" for how in masks), seen
    assert masks[0].values == (0.0, float("-inf"))
    assert all(torch.equal(g, e) for g, e in zip(grads, exact, strict=True))


def test_a_bool_tensor_is_kept_at_one_bit_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The condition a ``where`` keeps for backward (a bool tensor, a byte an element) is
    packed at 1 bit and restored exactly: the gradient is the compiled plain one."""
    seen = _recorded_treatments(monkeypatch)
    x = torch.randn(32, 128, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x, 0.5 * x).sum()

    (exact,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)
    torch._dynamo.reset()
    with actcore.compress_saved_tensors("G1.2", min_numel=1024):
        (grad,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)
    assert [how.kind for _, _, how in seen] and {how.kind for _, _, how in seen} == {"bits"}
    assert torch.equal(grad, exact)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_what_backward_exponentiates_is_kept_as_its_exponential(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A cross-entropy's vocabulary-sized saved tensor (its log-probabilities, or under
    inductor's partitioner its logits) is read in backward only through ``exp``: it is kept
    as ``exp(x - rowmax)`` at 4 bits, whose rounding is unbiased for what backward reads
    (the log-softmax backward is linear in it). The mean of 64 compiled gradients is within
    3 standard errors of the exact gradient (kept exact, the logits' 4 bytes an element)."""
    seen = _recorded_treatments(monkeypatch)
    torch.manual_seed(0)
    h = torch.randn(48, 16)
    w = (torch.randn(512, 16) * 2).requires_grad_()
    y = torch.randint(0, 512, (48,))

    def f(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(h @ w.t(), y)

    (exact,) = torch.autograd.grad(f(h, w, y), w)
    torch._dynamo.reset()
    fn = torch.compile(f, fullgraph=True, backend=backend)
    draws = []
    for _ in range(64):
        with actcore.compress_saved_tensors("G1.2", min_numel=1024):
            (g,) = torch.autograd.grad(fn(h, w, y), w)
        draws.append(g)
    wide = {how for _, shape, how in seen if shape in ((48, 512),)}
    assert {(how.kind, how.bits, how.why) for how in wide} == {
        ("exp", 4, "read through exp in backward")
    }, seen
    errors = torch.stack(draws) - exact
    assert all(torch.isfinite(g).all() for g in draws)
    single = errors.flatten(1).norm(dim=1).square().mean().sqrt()  # one draw's error
    assert 0 < single < 0.3 * exact.norm()
    assert errors.mean(0).norm() < 3 * single / len(draws) ** 0.5
