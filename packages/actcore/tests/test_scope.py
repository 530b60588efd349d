"""convert's whole-model scope: the forward's functional ops are compressed too, within the
root's forward only, with the Q-layers' tailored compressors, without changing outputs."""

from __future__ import annotations

import copy
import gc
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import forward_backward, grad_cosine
from torch import nn
from torch.profiler import ProfilerActivity, profile

import actcore
from actcore import memory
from actcore.layers.scope import ModelScope


class Functional(nn.Module):
    """A block written the way models are written today: functionals and inline products."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate = nn.Linear(d, 2 * d)
        self.down = nn.Linear(d, d)
        self.ln = nn.Parameter(torch.ones(d))
        self.scale = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = F.layer_norm(x, (d,), self.ln)
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, n, d)), 0.1, self.training)
        h = F.rms_norm(x, (d,))
        gate, up = self.gate(h).chunk(2, dim=-1)
        y = F.silu(gate) * up
        y = torch.sigmoid(y) * y + F.relu(y) + F.gelu(y)
        return x + self.scale * self.down(y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Functional(), Functional())


X = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, x: torch.Tensor = X, seed: int = 3):
    return forward_backward(model, x, seed=seed, mean=True)


def _profiled_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes one forward leaves allocated, by the CPU profiler (independent of actcore)."""
    model(x)  # warm-up
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x)
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("level", ["L0", "L2", "L3"])
def test_forward_bitwise_in_train_and_eval(level: str) -> None:
    ref = _model()
    conv = actcore.convert(copy.deepcopy(ref), level)
    out_ref, _ = _step(ref)
    out, grads = _step(conv)
    assert torch.equal(out, out_ref)
    assert all(torch.isfinite(g).all() for g in grads)
    ref.eval(), conv.eval()
    with torch.no_grad():
        assert torch.equal(conv(X), ref(X))


def test_l0_gradients_bitwise() -> None:
    ref = _model()
    _, g_ref = _step(ref)
    _, g = _step(actcore.convert(copy.deepcopy(ref), "L0"))
    assert all(torch.equal(a, b) for a, b in zip(g_ref, g, strict=True))


@pytest.mark.parametrize("level, cos", [("L2", 0.98), ("L3", 0.7)])
def test_gradients_close(level: str, cos: float) -> None:
    """One step of this 128-token toy: 0.999 at L2; 0.81 at L3 (0.85 with layers only: the
    2-bit linear inputs dominate the noise)."""
    ref = _model()
    _, g_ref = _step(ref)
    _, g = _step(actcore.convert(copy.deepcopy(ref), level))
    assert grad_cosine(g_ref, g) > cos


def test_functional_ops_are_compressed_beyond_the_q_layers() -> None:
    """The profiler's count of what one forward leaves allocated: the hybrid keeps far less
    than the Q-layers alone, which keep the functional ops' tensors in fp32."""
    x = torch.randn(8, 64, 64)
    fp32 = _profiled_bytes(_model(), x)
    layers = _profiled_bytes(actcore.convert(_model(), "L3", layers_only=True), x)
    hybrid = _profiled_bytes(actcore.convert(_model(), "L3"), x)
    assert fp32 / layers < 3
    assert fp32 / hybrid > 8, (fp32, layers, hybrid)
    model = actcore.convert(_model(), "L3")
    with memory.track(model) as rep:
        out = model(x)
    del out
    # the tracker's own count agrees with the profiler's within the input it also counts
    assert abs(rep.retained_bytes - hybrid) <= x.numel() * 4 + 64 * 1024


def test_scope_only_inside_the_root_forward() -> None:
    model = actcore.convert(_model(), "L3")
    seen: list[bool] = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(model.act_scope.active))
    x = X.clone().requires_grad_()
    modes = torch._C._len_torch_function_stack()
    out = model(x)
    assert seen == [True] and not model.act_scope.active
    assert torch._C._len_torch_function_stack() == modes  # the router's mode is popped
    # a loss computed after the forward keeps its saved tensors as torch does
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = out.square().mean()
    assert len(saved) == 1 and saved[0] is out
    loss.backward()
    with torch.no_grad():  # no pending backward: nothing is pushed
        model(X)
    assert seen[-1] is False


def test_reentrant_and_nested_models() -> None:
    inner = actcore.convert(_model(), "L3")

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.head = nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.inner(self.inner(x)))

    outer = actcore.convert(Outer(), "L2")
    out = outer(X)
    assert not outer.act_scope.active and not inner.act_scope.active
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in outer.parameters())


def _bytes_by_block(model: nn.Module) -> dict[str, int]:
    with memory.track(model) as rep:
        out = model(X)
    del out
    blocks: dict[str, int] = {}
    for name, held in rep.by_module.items():
        blocks[name.split(".")[0]] = blocks.get(name.split(".")[0], 0) + held
    return blocks


def test_excluded_module_keeps_what_it_saves() -> None:
    """An excluded block (and everything inside it) keeps its saved tensors as torch does;
    the other block is compressed."""
    conv = actcore.convert(_model(), "L3", exclude=("0",))
    assert conv.act_report.left["0"] == "excluded"
    assert not any(isinstance(m, actcore.QLayer) for m in conv[0].modules())
    assert isinstance(conv[1].qkv, actcore.QLinear)
    plain, held = _bytes_by_block(_model()), _bytes_by_block(conv)
    assert held["0"] == plain["0"]
    assert held["1"] * 8 < plain["1"]
    out, _grads = _step(conv)
    assert torch.equal(out, _step(_model())[0])


def test_tensor_a_q_layer_packed_is_not_stored_twice() -> None:
    """``h`` is saved by tanh (its output), by the QLinear ``b`` and by a product: it is
    packed once at 4 bits and shared, next to the 4-bit copy of ``x`` that ``a`` keeps (each
    with one int8 scale exponent per channel, outlier channels apart; tanh's input, which
    backward uses nonlinearly, also keeps its largest channel exact with its int64 index)."""

    class Thrice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)
            self.w = nn.Parameter(torch.ones(256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            return self.b(h) + h * self.w

    x = torch.randn(64, 256, requires_grad=True)
    model = actcore.convert(Thrice(), "L2", fewbit_bits=None)
    with memory.track(model) as rep:
        out = model(x)
    one = actcore.ops.quantize(x.detach(), 4).nbytes
    exponents = 256  # int8 per channel (ChannelScaled)
    exact = 64 * 4 + 8  # tanh's input: one fp32 channel of 64 rows and its index
    assert rep.retained_bytes == 2 * one + 2 * exponents + exact
    out.sum().backward()
    layers_only = actcore.convert(Thrice(), "L2", fewbit_bits=None, layers_only=True)
    with memory.track(layers_only) as rep:
        out = layers_only(x)
    # tanh's output kept in fp32
    assert rep.retained_bytes == 2 * one + 2 * exponents + x.numel() * 4


def test_copies_and_pickles_of_a_converted_model() -> None:
    model = actcore.convert(_model(), "L3")
    clone = copy.deepcopy(model)
    assert isinstance(clone.act_scope, ModelScope) and clone.act_scope is not model.act_scope
    restored = pickle.loads(pickle.dumps(model))
    for m in (clone, restored):
        out, _grads = _step(m)
        assert torch.equal(out, _step(_model())[0])
        assert not m.act_scope.active


def test_a_sequential_root_keeps_its_name_state_and_class_after_conversion() -> None:
    """A root whose forward is torch's (``nn.Sequential``) gets a subclass with a forward of
    actcore's (so torch.compile runs the scope's pre-hook outside the compiled frame): still
    a ``Sequential`` by name and ``isinstance``, the same keys and outputs, picklable, and
    its own class again once the scope is removed."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = actcore.convert(copy.deepcopy(plain), "L3")
    assert isinstance(model, nn.Sequential) and type(model) is not nn.Sequential
    assert type(model).__name__ == "Sequential" and repr(model).startswith("Sequential(")
    assert list(model.state_dict()) == list(plain.state_dict())
    x = torch.randn(5, 8)
    restored = pickle.loads(pickle.dumps(model))
    for m in (model, restored, model[0:3]):
        assert torch.equal(m(x), plain(x))
    actcore.convert(model, "L3", layers_only=True)
    assert type(model) is nn.Sequential


def test_convert_twice_is_one_scope_and_layers_only_removes_it() -> None:
    model = actcore.convert(_model(), "L3")
    hooks = len(model._forward_pre_hooks)
    actcore.convert(model, "L2")
    assert len(model._forward_pre_hooks) == hooks and model.act_scope.spec.name == "L2"
    actcore.convert(model, "L2", layers_only=True)
    assert model.act_scope is None and len(model._forward_pre_hooks) == hooks - 1
    assert model.act_report.scope is None


def test_threads_each_have_their_own_scope() -> None:
    model = actcore.convert(_model(), "L3").eval()  # eval: no dropout, grads still flow
    ref_out = _model().eval()(X).detach()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(3):
                out = model(X)
                assert torch.equal(out.detach(), ref_out)
                out.sum().backward()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not model.act_scope.active


def test_inplace_op_on_a_q_layer_output_view() -> None:
    """A linear of a 4-d input returns a view in torch; in-place ops on it must work."""
    model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    actcore.convert(model, "L3")
    x = torch.randn(1, 15, 15, 2)
    out = model(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()


@pytest.mark.parametrize("bad", [42, "model", None])
def test_convert_rejects_non_modules(bad) -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        actcore.convert(bad)


def test_convert_rejects_scripted_and_traced_models() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for compiled in (torch.jit.script(model), torch.jit.trace(model, torch.randn(2, 4))):
        with pytest.raises(TypeError, match="scripted or traced"):
            actcore.convert(compiled)


class _ConvNeXtish(nn.Module):
    """A ConvNeXt-style block: depthwise conv, channels-last layer norm, GELU, layer scale."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.scale = nn.Parameter(torch.full((c,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(x).permute(0, 2, 3, 1)
        h = F.layer_norm(h, h.shape[-1:], self.norm.weight, self.norm.bias)
        h = self.down(F.gelu(self.up(h)))
        return x + (self.scale * h).permute(0, 3, 1, 2)


def _assert_compiled_keeps_the_saving(base: nn.Module, x: torch.Tensor) -> None:
    """Converted at L3 and compiled (aot_eager): > 6x eagerly, >= 80% of that compiled, the
    forward equal to ``base``'s under the same RNG, finite gradients."""
    fp = _profiled_bytes(copy.deepcopy(base), x)
    eager = _profiled_bytes(actcore.convert(copy.deepcopy(base), "L3"), x)
    model = actcore.convert(copy.deepcopy(base), "L3")
    compiled = torch.compile(model, backend="aot_eager")
    held = _profiled_bytes(compiled, x)
    assert fp / eager > 6
    assert fp / held >= 0.8 * fp / eager, (fp, eager, held)
    torch.manual_seed(1)
    out = compiled(x)
    torch.manual_seed(1)
    assert torch.equal(out, base(x))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_compiled_model_keeps_the_saving() -> None:
    """Under torch.compile (aot_eager: AOTAutograd's partitioner decides what is saved) the
    scope's hooks are entered outside the compiled graph, so what it saves is compressed."""
    torch.manual_seed(0)
    base = nn.Sequential(_ConvNeXtish(), _ConvNeXtish())
    x = torch.randn(4, 16, 16, 16)
    _assert_compiled_keeps_the_saving(base, x)


def test_compiled_convnext_blocks_keep_the_saving() -> None:
    """torchvision's ConvNeXt block (a layer-scale product, then stochastic depth) under
    torch.compile: Q-layers and routed calls run eagerly inside the compiled model (graph
    breaks), the mode's bookkeeping steps aside while Dynamo traces, and the saving holds."""
    cnblock = pytest.importorskip("torchvision.models.convnext").CNBlock
    stochastic_depth = pytest.importorskip("torchvision.ops").StochasticDepth

    class Head(nn.Module):  # a linear, a layer scale and stochastic depth, as ConvNeXt's
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.scale = nn.Parameter(torch.full((16,), 0.5))
            self.drop = stochastic_depth(0.2, "row")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.scale * self.lin(x))

    torch.manual_seed(0)
    base = nn.Sequential(
        *(cnblock(16, layer_scale=0.5, stochastic_depth_prob=0.2) for _ in range(2)),
        nn.Flatten(2),
        Head(),
    )
    x = torch.randn(4, 16, 4, 4)
    _assert_compiled_keeps_the_saving(base, x)


def test_history_free_data_is_compressed_and_constants_are_exact() -> None:
    """Without autograd history: features derived from the input (a no-grad dropout of
    node features) are data, compressed; a table made in the forward from positions (rotary
    cos) is a constant of the forward, kept exact (2 bits would scramble every q's grad)."""

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128) / 12)
            self.register_buffer("freq", torch.rand(128))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.dropout(x, 0.5, self.training)  # history-free: x needs no grad
            q = h @ self.w  # saves h: data
            cos = torch.cos(torch.arange(x.shape[1]).float()[:, None] * self.freq)
            return q * cos  # saves cos: a constant

    x = torch.randn(8, 64, 128)
    model = actcore.convert(Rotary(), "L3")
    with memory.track(model) as rep:
        out = model(x)
    h_4bit = actcore.ops.quantize(x.reshape(-1, 128), 4).nbytes  # matmul saves h folded
    # with its outlier channel kept apart: int8 exponents, one exact channel and its index
    h_apart = 128 + 512 * 4 + 8
    cos_fp32 = 64 * 128 * 4
    assert rep.retained_bytes == h_4bit + h_apart + cos_fp32  # L3 keeps such tensors at 4 bits
    out.sum().backward()
    ref = Rotary()
    ref.load_state_dict(model.state_dict())
    torch.manual_seed(0)
    (ref(x) * 1).sum().backward()
    assert torch.isfinite(model.w.grad).all()


def test_dropout_output_is_rebuilt_from_its_input_packing(monkeypatch) -> None:
    """Attention probabilities after dropout: the product saves ``dropout(p)``, which is kept
    as a reference to ``p``'s 4-bit packing (saved by softmax) and the dropout's 1-bit mask:
    nothing more is stored (without the mechanism: a 4-bit copy of it)."""

    class Probs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64) / 8)

        def forward(self, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(s @ self.w, dim=-1)
            return F.dropout(p, 0.2, self.training) @ v

    s, v = torch.randn(8, 64, 64), torch.randn(8, 64, 64, requires_grad=True)

    def held() -> int:
        model = actcore.convert(Probs(), "L3")
        with memory.track(model) as rep:
            out = model(s, v)
        out.sum().backward()
        assert torch.isfinite(v.grad).all() and torch.isfinite(model.w.grad).all()
        return rep.retained_bytes

    rebuilt = held()
    import actcore.layers.masked_functions as masked_functions

    monkeypatch.setattr(masked_functions, "note_dropout_output", lambda out: out)
    copy_4bit = actcore.ops.quantize(torch.randn(8, 64, 64), 4).nbytes
    apart = 64 + 512 * 4 + 8  # int8 exponents, the exact channel (512 rows), its index
    assert held() - rebuilt == copy_4bit + apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_a_learned_mask_matches_under_autocast(dtype) -> None:
    """A mask that requires grad (T5's position bias) makes torch pick another attention
    kernel; the routed call picks the same one (bitwise forward), keeps no graph of it, and
    the backward rerun happens under the forward's autocast (mixed q/k/v dtypes)."""

    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 4, 64, 64))
            self.qkv = nn.Linear(32, 96)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
            q, k = q.float(), k.float()  # fp32 meets the projections' dtype (rotary-like)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=1.0)

    torch.manual_seed(0)
    plain = Biased()
    model = actcore.convert(copy.deepcopy(plain), "L2")
    x = torch.randn(2, 64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ref = plain(x)
        out = model(x)
    assert torch.equal(out, ref)
    gc.collect()
    assert not [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor)
        and o.shape == (2, 4, 64, 64)
        and o is not ref
        and o is not out
        and o.grad_fn is not None
        and "Softmax" in type(o.grad_fn).__name__
    ]
    ref.float().square().sum().backward()
    out.float().square().sum().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0) > 0.95
