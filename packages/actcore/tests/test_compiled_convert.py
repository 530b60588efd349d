"""A converted model under torch.compile: one graph, its Q-layers traced as their plain
modules, and what the graph saves packed by the scope's inlined hooks with the level's bits
by kind (:mod:`actcore.saved_tensors.compiled`)."""

from __future__ import annotations

import copy
import math
import os
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.bench.gpt import CharGPT, GPTConfig
from actcore.config import level_spec
from actcore.memory import profiled_bytes
from actcore.saved_tensors import compiled, partition_pass
from actcore.saved_tensors.graph_treatment import (
    RECOMPUTED_STATISTICS_BITS,
    GraphPolicy,
    Treatment,
)

pytestmark = pytest.mark.skipif(
    not compiled.inlining_supported(), reason="this torch does not inline saved-tensor hooks"
)
torchvision = pytest.importorskip("torchvision")

BACKEND = "aot_eager"  # AOTAutograd's partitioning and the inlined hooks, without codegen
ROW_NORM_BITS = level_spec("L3").row_norm_bits


def _resnet() -> tuple[nn.Module, tuple, Callable]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return model, (torch.randn(4, 3, 64, 64),), lambda out: out.square().mean()


def _vit() -> tuple[nn.Module, tuple, Callable]:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128,
        num_classes=10,
    )  # fmt: skip
    nn.init.normal_(model.heads.head.weight, std=0.02)  # (torchvision starts it at zero)
    return model, (torch.randn(8, 3, 32, 32),), lambda out: out.square().mean()


def _gpt(arch: str) -> Callable[[], tuple[nn.Module, tuple, Callable]]:
    def build() -> tuple[nn.Module, tuple, Callable]:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=65, context=64, layers=2, heads=4, width=64, arch=arch)
        idx = torch.randint(0, 65, (8, 64), generator=torch.Generator().manual_seed(1))
        return CharGPT(cfg), (idx, idx.roll(-1, 1)), lambda out: out

    return build


def _mobilenet() -> tuple[nn.Module, tuple, Callable]:
    """Hardswish modules (routed), squeeze-excitation gates (few-bit Hardsigmoid modules),
    in-place activations, dropout."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    return model, (torch.randn(4, 3, 64, 64),), lambda out: out.square().mean()


MODELS = {"resnet18": _resnet, "vit": _vit, "gpt": _gpt("gpt"), "llama": _gpt("llama")}
ONE_GRAPH = {**MODELS, "mobilenet_v3_small": _mobilenet}


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _step(model: nn.Module, fn: Any, args: tuple, loss: Callable) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss(fn(*args)).backward()
    return _grads(model)


@pytest.mark.parametrize("name", ONE_GRAPH)
def test_a_converted_model_compiles_into_one_graph(name: str) -> None:
    """fullgraph=True, no graph break (explain), no recompilation on later steps, the
    forward bitwise the compiled plain model's, and fewer bytes kept than it."""
    base, args, loss = ONE_GRAPH[name]()
    model = actcore.convert(copy.deepcopy(base), "L3")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        r.reason for r in explained.break_reasons
    ]
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True, backend=BACKEND)
    _step(model, fn, args, loss)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            assert torch.isfinite(_step(model, fn, args, loss)).all()
        torch.manual_seed(5)
        out = fn(*args)
    plain = torch.compile(copy.deepcopy(base), fullgraph=True, backend=BACKEND)
    torch.manual_seed(5)
    assert torch.equal(out, plain(*args))
    _, held = profiled_bytes(lambda: loss(fn(*args)))
    _, plain_held = profiled_bytes(lambda: loss(plain(*args)))
    assert plain_held / held > 4, (plain_held, held)


# The share of eager ACT's ratio (against eager plain) that compiled ACT keeps against
# compiled plain, and the gradient cosine of compiled L3 against the exact gradient. Target
# (#29): a share >= 0.9. Measured (aot_eager, 2026-11-27, other seeds than these): resnet18
# 0.71, cosine 0.82 against eager L3's 0.85 (its ReLU outputs that a convolution reads are
# a mask plus values at 2 bits where eager keeps only the nonzeros; fixed bits by kind, no
# per-sample adaptive bits in compiled graphs yet); vit 1.55, 0.986 (0.986); gpt 0.91,
# 0.984 (0.987); llama 0.54, 0.93 (0.97): its cross-entropy keeps the vocabulary-sized
# log-probabilities, SwiGLU's product is saved besides its operands, and RMS-norm inputs
# take 8 bits (COMPILED_ROW_NORM_BITS). 2026-11-29, with the native packing and norms
# recomputed (these seeds): resnet18 0.75, 0.814 (0.831); gpt 0.92; llama 0.70, 0.931 (0.965).
# Later that day, with 1-bit masks and the log-probabilities kept as their exponential at 4
# bits: gpt 1.14, 0.987 (0.989); llama 0.83, 0.929 (0.965). 2026-11-29 (later session), with
# recomputed RMS norms' means saved exact and their inputs at 4 bits: llama 0.92, 0.922; vit
# 1.75, 0.990 (its layer norms keep 8 bits: backward replays their statistics). 2026-11-30,
# max-pooling indices as 4-bit window offsets (were int16): resnet18 0.81.
FLOORS = {"resnet18": (0.78, 0.75), "vit": (1.5, 0.95), "gpt": (1.05, 0.97), "llama": (0.88, 0.9)}


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_converted_sequential_compiles_into_one_graph(how: str) -> None:
    """torch.compile traces the whole call of a module whose forward is torch's (an
    ``nn.Sequential``), hooks included: a converted one still compiles with
    ``fullgraph=True``, its saves packed, its forward the compiled plain one's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 32, 32)
    outputs, held = [], []
    for convert_it in (False, True):
        model = copy.deepcopy(base)
        if convert_it:
            actcore.convert(model, "L3")
        torch._dynamo.reset()
        if how == "torch.compile":
            fn = torch.compile(model, fullgraph=True, backend=BACKEND)
        else:
            model.compile(fullgraph=True, backend=BACKEND)
            fn = model
        fn(x).sum().backward()
        out, kept = profiled_bytes(lambda fn=fn: fn(x))
        outputs.append(out)
        held.append(kept - out.numel() * out.element_size())  # (less the output itself)
    assert torch.equal(outputs[0], outputs[1])
    assert held[1] * 4 < held[0], held


@pytest.mark.parametrize("name", MODELS)
def test_compiled_keeps_about_what_eager_keeps(name: str) -> None:
    base, args, loss = MODELS[name]()
    ratios, cosines = {}, {}
    exact = None
    for compile_it in (False, True):
        torch._dynamo.reset()
        plain = copy.deepcopy(base)
        act = actcore.convert(copy.deepcopy(base), "L3")
        fns = [torch.compile(m, backend=BACKEND) if compile_it else m for m in (plain, act)]
        held = []
        for model, fn in zip((plain, act), fns, strict=True):
            _step(model, fn, args, loss)  # (compiles)
            held.append(profiled_bytes(lambda fn=fn: loss(fn(*args)))[1])
        ratios[compile_it] = held[0] / held[1]
        grads = [_step(m, fn, args, loss).double() for m, fn in zip((plain, act), fns, strict=True)]
        exact = grads[0] if exact is None else exact
        cosines[compile_it] = F.cosine_similarity(grads[1], exact, 0).item()
    share, cosine = FLOORS[name]
    assert ratios[True] >= share * ratios[False], ratios
    assert cosines[True] >= cosine, cosines


class _Spy:
    """Records the treatment of every tensor a compiled graph packs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[tuple[int, ...], Treatment]] = []
        original = compiled.treatment

        def spy(x: torch.Tensor, policy: Any, context: Any) -> Treatment:
            how = original(x, policy, context)
            self.seen.append((tuple(x.shape), how))
            return how

        monkeypatch.setattr(compiled, "treatment", spy)

    def whys(self) -> dict[str, set[Any]]:
        found: dict[str, set[Any]] = {}
        for _, how in self.seen:
            found.setdefault(how.why, set()).add(how.bits)
        return found


class _Mixed(nn.Module):
    """A conv / batch norm / ReLU / max pool stem, then a pre-norm GELU MLP over the pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(self.pool(F.relu(self.bn(self.conv(x)))))
        t = h.flatten(2).transpose(1, 2)
        return (t + self.down(F.gelu(self.up(self.norm(t))))).mean()


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
def test_level_bits_by_kind(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """L3's bits by kind reach the compiled graph: conv inputs 2, the batch norm's input 2,
    the GELU's input 4, the layer norm's 8 (its statistics are recomputed from it); the
    norm's and the GELU's outputs, which the
    linears read, are recomputed from those (as the eager route derives them), not saved;
    nothing large stays exact but statistics and integer tensors, decomposed (inductor's
    decompositions, ``aot_eager_decomp_partition``) or not."""
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    model = actcore.convert(_Mixed(), "L3")
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(4, 3, 16, 16)).backward()
    packed = {(shape, how.kind, how.bits, how.why) for shape, how in spy.seen}
    assert ((4, 3, 16, 16), "quantize", 2, "a product input") in packed, packed
    assert ((4, 16, 8, 8), "quantize", 2, "a product input") in packed, packed
    assert ((4, 16, 16, 16), "quantize", 2, "a batch_norm input") in packed, packed
    norm_inputs = {how.bits for _, how in spy.seen if how.why == "a row_norm input"}
    assert norm_inputs == {RECOMPUTED_STATISTICS_BITS}, packed
    gelu_inputs = [how for shape, how in spy.seen if shape == (256, 64)]
    assert {how.bits for how in gelu_inputs} == {4}, packed  # the GELU's output: not saved
    assert not [s for s, how in spy.seen if s in ((256, 16), (4, 64, 16)) and how.bits == 2]
    kept = [(shape, how.why) for shape, how in spy.seen if how.kind == "keep"]
    assert all(
        math.prod(shape) < 1024 or "statistic" in why or "float" in why for shape, why in kept
    ), kept


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_relu_before_max_pool_keeps_a_mask_and_window_offsets(
    monkeypatch: pytest.MonkeyPatch, layout: torch.memory_format
) -> None:
    """A ReLU that only its backward and a max pool's read is its 1-bit mask, the pool's
    indices their offsets inside the windows (2 bits for 2x2, where an int64 took 64): the
    gradients are bitwise the compiled plain model's, in either memory format."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.linspace(-1, 1, 8).view(1, 8, 1, 1))
            self.register_buffer("weight", torch.randn(8, 16, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (F.max_pool2d(F.relu(x + self.shift), 2) * self.weight).sum()

    spy = _Spy(monkeypatch)
    x = torch.randn(4, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    x = x.contiguous(memory_format=layout)
    grads = []
    for level in (None, "L3"):
        torch.manual_seed(0)
        model = Net() if level is None else actcore.convert(Net(), level)
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True, backend=BACKEND)(x).backward()
        grads.append(model.shift.grad)
    kinds = {how.kind for _, how in spy.seen}
    assert {"mask", "offset"} <= kinds, kinds  # (the argmax in 2 bits: its 2x2 window)
    assert {how.bits for _, how in spy.seen if how.kind == "offset"} == {2}
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    ("pool", "bits"),
    [
        (lambda x: F.max_pool2d(x, 3, 2, 1), 4),  # (ResNet's)
        (lambda x: F.max_pool2d(x, (3, 2), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True), 3),
        (lambda x: F.max_pool2d(x, kernel_size=2, stride=None, padding=0), 2),
        (lambda x: F.max_pool3d(x.unflatten(2, (4, 8)), 2, 2), 3),
    ],
)
def test_max_pool_indices_come_back_exactly(
    monkeypatch: pytest.MonkeyPatch, pool: Callable, bits: int
) -> None:
    """A max pool's indices, packed as window offsets whatever its geometry, come back to
    the same input gradient as compiled plain's (a mismatch would route it elsewhere)."""
    spy = _Spy(monkeypatch)
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    # (a gradient that differs by output, from a backward that reads no saved tensor)
    plain, packed = _pooled_grads(lambda x: pool(x).flatten().cumsum(0).sum(), x, BACKEND)
    assert {how.bits for _, how in spy.seen if how.kind == "offset"} == {bits}
    assert torch.equal(plain, packed)


def test_inductors_pool_offsets_are_packed_at_their_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under inductor a max pool saves its argmax as int8 offsets inside the windows (its
    low-memory pool): packed at the window's 4 bits, the gradient stays bitwise."""
    spy = _Spy(monkeypatch)
    shift = torch.linspace(-1, 1, 8).view(1, 8, 1, 1)
    x = (torch.randn(4, 8, 32, 32) + shift).requires_grad_()
    plain, packed = _pooled_grads(
        lambda x: F.max_pool2d(F.relu(x), 3, 2, 1).flatten().cumsum(0).sum(), x, "inductor"
    )
    offsets = [how for _, how in spy.seen if how.kind == "offset"]
    assert offsets and {(how.bits, how.dtype) for how in offsets} == {(4, torch.int8)}
    assert torch.equal(plain, packed)


def _pooled_grads(fn: Callable, x: torch.Tensor, backend: str) -> list[torch.Tensor]:
    """``x``'s gradient of ``fn`` compiled with ``backend``, plain and under the hooks."""
    grads = []
    for scope in (False, True):
        torch._dynamo.reset()
        compiled_fn = torch.compile(fn, backend=backend)
        with actcore.compress_saved_tensors("G1.2", min_numel=256) if scope else nullcontext():
            loss = compiled_fn(x)
        grads.append(torch.autograd.grad(loss, x)[0])
    return grads


def test_level_zero_compiles_to_the_plain_gradients() -> None:
    base, args, loss = _resnet()
    grads = []
    for level in (None, "L0"):
        model = (
            copy.deepcopy(base) if level is None else actcore.convert(copy.deepcopy(base), level)
        )
        torch._dynamo.reset()
        grads.append(
            _step(model, torch.compile(model, fullgraph=True, backend=BACKEND), args, loss)
        )
    assert torch.equal(grads[0], grads[1])


def test_transposed_saved_tensors_keep_their_strides() -> None:
    """A saved tensor that is a transpose comes back with its strides (the backward graph's
    views of it rely on them)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x).transpose(1, 2)  # (b, 32, t), not contiguous
            return (h @ h.transpose(1, 2)).view(-1).square().mean()

    x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(0))
    model = actcore.convert(Net(), "L2")
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=BACKEND)(x).backward()
    assert torch.isfinite(model.lin.weight.grad).all()


def test_sequence_lengths_share_one_dynamic_graph() -> None:
    """Compiled with ``dynamic=True``, a converted GPT runs three sequence lengths on one
    graph (no recompilation), each step with finite gradients."""
    model, _, loss = _gpt("llama")()
    model = actcore.convert(model, "L3")
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True, dynamic=True, backend=BACKEND)
    idx = torch.randint(0, 65, (4, 64), generator=torch.Generator().manual_seed(2))
    _step(model, fn, (idx[:, :32], idx[:, 1:33]), loss)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (48, 63):
            assert torch.isfinite(_step(model, fn, (idx[:, :t], idx[:, 1 : t + 1]), loss)).all()


def test_bf16_autocast_forward_is_the_compiled_plain_one() -> None:
    base, args, _ = _gpt("gpt")()
    outs = []
    for level in (None, "L3"):
        model = (
            copy.deepcopy(base) if level is None else actcore.convert(copy.deepcopy(base), level)
        )
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True, backend=BACKEND)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*args)
        out.backward()
        outs.append(out.detach())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.equal(outs[0], outs[1])


def test_composes_with_the_partitioners_memory_budget() -> None:
    """Under ``activation_memory_budget`` the partitioner saves fewer tensors and recomputes
    from them in backward; the hooks pack what it saves, except where backward replays a
    mask, an argmax or a convolution from it (there a rounded copy would decide them anew:
    the image a ResNet's first convolution is replayed from). The forward is the compiled
    plain model's under the same budget."""
    base, args, loss = _resnet()
    runs = {}
    for name, budget in (("plain", 0.5), ("act", 1.0), ("act", 0.5)):
        model = copy.deepcopy(base)
        if name == "act":
            actcore.convert(model, "L3")
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            fn = torch.compile(model, backend="aot_eager_decomp_partition")
            loss(fn(*args)).backward()  # (compiles)
            torch.manual_seed(3)
            out = fn(*args)
            held = profiled_bytes(lambda fn=fn: loss(fn(*args)))[1]
            model.zero_grad(set_to_none=True)
            loss(fn(*args)).backward()
        runs[name, budget] = out, held, _grads(model).double()
    eager = copy.deepcopy(base)
    exact = _step(eager, eager, args, loss)
    plain_out, plain_held, plain_grads = runs["plain", 0.5]
    out, held, grads = runs["act", 0.5]
    assert torch.equal(out, plain_out)
    assert plain_held > 3 * held, (plain_held, held)  # measured 3.8x (2026-11-29)
    assert held <= runs["act", 1.0][1], (held, runs["act", 1.0][1])
    assert F.cosine_similarity(plain_grads, exact.double(), 0) > 0.9999
    # measured 0.977 (2026-11-29); 0.63 when the image was packed at 2 bits and the first
    # convolution, its norm's statistics, its ReLU's mask and the max pool replayed from it
    assert F.cosine_similarity(grads, plain_grads, 0) > 0.95


def _plain_and_converted(
    base: nn.Module, x: torch.Tensor
) -> dict[str, tuple[torch.Tensor, int, torch.Tensor]]:
    """``base`` (a module returning its loss) compiled with ``fullgraph=True`` as it is and
    converted at L3 (checked to be one graph): per variant, the forward under seed 3, the
    bytes one forward keeps (profiler) and the gradients of one step after compiling."""
    runs = {}
    for name in ("plain", "act"):
        model = copy.deepcopy(base)
        if name == "act":
            actcore.convert(model, "L3")
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(x)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True, backend=BACKEND)
        fn(x).backward()  # (compiles)
        torch.manual_seed(3)
        out = fn(x)
        held = profiled_bytes(lambda fn=fn: fn(x))[1]
        model.zero_grad(set_to_none=True)
        fn(x).backward()
        runs[name] = out, held, _grads(model).double()
    return runs


class _DropoutAttention(nn.Module):
    """Causal self-attention with attention dropout (GPT-2's, BERT's and T5's in training)."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(width, -1)
        )
        p = 0.1 if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, width)).square().mean()


def test_attention_that_draws_dropout_compiles() -> None:
    """An attention call with dropout is traced as it is, not recomputed in backward from its
    packed q, k and v: replaying its draw would save torch's random state, on which
    AOTAutograd's inlining of the hooks failed (a converted GPT-2, BERT or T5 in training did
    not compile). One graph, the compiled plain forward under one seed, fewer bytes."""
    torch.manual_seed(0)
    runs = _plain_and_converted(_DropoutAttention(), torch.randn(4, 64, 64))
    assert torch.equal(runs["act"][0], runs["plain"][0])
    assert torch.isfinite(runs["act"][2]).all()
    assert runs["plain"][1] > 2 * runs["act"][1], (runs["plain"][1], runs["act"][1])


class _CheckpointedMLPs(nn.Module):
    """Pre-norm GELU MLP blocks, each run through non-reentrant checkpointing in forward."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.ups = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(depth))
        self.downs = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x + self.downs[i](F.gelu(self.ups[i](self.norms[i](x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.ups)):
            x = torch.utils.checkpoint.checkpoint(self.block, i, x, use_reentrant=False)
        return self.head(x).square().mean()


def test_checkpointing_inside_the_compiled_region() -> None:
    """Blocks checkpointed inside the compiled forward: one graph, the forward the compiled
    plain model's, what the graph saves (the blocks' inputs) packed, gradients close."""
    torch.manual_seed(0)
    runs = _plain_and_converted(_CheckpointedMLPs(), torch.randn(8, 128, 64))
    assert torch.equal(runs["act"][0], runs["plain"][0])
    assert runs["plain"][1] > 2 * runs["act"][1], (runs["plain"][1], runs["act"][1])
    # measured 0.9992 on this seed (2026-11-29)
    assert F.cosine_similarity(runs["act"][2], runs["plain"][2], 0) > 0.99


def _compiled_grads(base: nn.Module, step: Callable[[Any, nn.Module], None]) -> list[Any]:
    """The gradients ``step(compiled, model)`` leaves on ``base`` compiled as it is and on
    ``base`` converted at L3 and compiled."""
    grads = []
    for level in (None, "L3"):
        model = copy.deepcopy(base)
        if level is not None:
            actcore.convert(model, level)
        torch._dynamo.reset()
        step(torch.compile(model, backend=BACKEND), model)
        grads.append(_grads(model).double())
    return grads


@pytest.mark.parametrize(("name", "floor"), [("resnet18", 0.75), ("gpt", 0.97)])
def test_bf16_autocast_keeps_the_weights_exact(
    monkeypatch: pytest.MonkeyPatch, name: str, floor: float
) -> None:
    """Under autocast a weight reaches its convolution or matrix product as a bf16 copy made
    inside the graph, which the graph saves: kept exact, as the layer route keeps weights
    (packed at the level's bits, a ResNet-18's gradient cosine was 0.05)."""
    spy = _Spy(monkeypatch)
    base, args, loss = MODELS[name]()

    def step(fn: Any, model: nn.Module) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(1)
            out = loss(fn(*args))
        out.float().backward()

    grads = _compiled_grads(base, step)
    weights = {tuple(p.shape[::k]) for p in base.parameters() if p.dim() > 1 for k in (1, -1)}
    packed = {shape for shape, how in spy.seen if how.bits is not None}
    assert not weights & packed, weights & packed
    # measured 2026-11-29: resnet18 0.832 (fp32 compiled: 0.83, FLOORS), gpt 0.984; with
    # the weights packed 0.054 and 0.965
    assert F.cosine_similarity(grads[0], grads[1], 0) > floor


def test_a_batch_norm_input_is_packed_normalized(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch norm's saved input is packed as its channels normalized over the batch (the
    bits the level gives it assume so): with batch 2 at 32x32, ResNet-18's last norms see 2
    values a channel, and their raw inputs came back with errors that the norm's 1 / std
    multiplied (gradient cosine to compiled plain 0.18)."""
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)

    def step(fn: Any, model: nn.Module) -> None:
        for _ in range(2):  # (the first compiles)
            model.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()

    grads = _compiled_grads(base, step)
    norms = [how for _, how in spy.seen if how.why.startswith("a batch_norm input")]
    assert norms and all(how.normalized for how in norms)
    assert F.cosine_similarity(grads[0], grads[1], 0) > 0.7  # measured 0.78 (2026-11-29)


def test_channels_last_is_packed_channel_by_channel() -> None:
    """A channels-last ResNet-18 keeps the gradient of a contiguous one: its convolution
    inputs are quantized channel by channel, not in memory order, where each group of 256
    elements held every channel of a few pixels (gradient cosine to compiled plain 0.69,
    against 0.81 contiguous)."""
    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)

    def step(fn: Any, model: nn.Module) -> None:
        torch.manual_seed(1)
        fn(x).square().mean().backward()

    grads = _compiled_grads(base, step)
    assert F.cosine_similarity(grads[0], grads[1], 0) > 0.77  # measured 0.81 (2026-11-30)


@pytest.mark.parametrize("kind", ["quantize", "relu", "mask"])
def test_a_tensor_packed_in_another_order_comes_back_with_its_strides(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Packed channel by channel, a channels-last tensor is unpacked with its own strides
    (the backward graph's views of a saved tensor may rely on them) and its values."""
    x = torch.randn(2, 8, 5, 7).relu().contiguous(memory_format=torch.channels_last)
    how = Treatment(kind, None if kind == "mask" else 8, channel_dim=1)
    monkeypatch.setattr(compiled, "treatment", lambda *_: how)
    policy = GraphPolicy(bits=2, min_numel=1)
    packed = compiled._pack_graph(x, policy, None)
    assert packed[-1][4] == (0, 1, 2, 3)  # (the order packed: channels after the batch)
    restored = compiled._unpack_graph(packed, policy)
    assert restored.shape == x.shape and restored.stride() == x.stride()
    if kind == "mask":
        assert torch.equal(restored > 0, x > 0)
    else:
        torch.testing.assert_close(restored, x, atol=0.02, rtol=0)


def test_layers_only_still_compresses_when_compiled() -> None:
    """Without a scope (``layers_only=True``) nothing would pack a compiled graph's saves:
    its Q-layers and few-bit activations run eagerly, compressing, between graphs."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Hardsigmoid())
    x = torch.randn(64, 256)
    held = {}
    for name, model in (
        ("plain", copy.deepcopy(base)),
        ("layers", actcore.convert(copy.deepcopy(base), "L3", layers_only=True)),
    ):
        torch._dynamo.reset()
        fn = torch.compile(model, backend=BACKEND)
        fn(x).sum().backward()
        held[name] = profiled_bytes(lambda fn=fn: fn(x).sum())[1]
    assert held["plain"] > 4 * held["layers"], held


def test_a_zero_channel_in_half_precision_stays_finite() -> None:
    """A channel of zeros gets a scale its dtype holds (fp16's smallest normal, not 2^-126,
    which fp16 rounds to 0 and would divide 0 by 0)."""
    a = torch.randn(64, 32, dtype=torch.float16)
    a[:, 3] = 0
    w = torch.randn(32, 16, dtype=torch.float16, requires_grad=True)
    fn = torch.compile(lambda a, w: (a @ w).float().square().sum(), backend=BACKEND)
    torch._dynamo.reset()
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
        loss = fn(a, w)
    loss.backward()
    assert torch.isfinite(w.grad).all()


def test_angles_read_by_sin_and_cos_are_kept_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotary angles run to hundreds of radians: rounded at a few bits, their sine and
    cosine in backward would be noise. A tensor backward reads through sin or cos is kept."""
    spy = _Spy(monkeypatch)
    positions = torch.arange(512.0).requires_grad_()
    x = torch.randn(512, 8, requires_grad=True)
    frequencies = torch.logspace(0, -3, 8)

    def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None] * frequencies
        return (x * torch.cos(angles) + x * torch.sin(angles)).square().sum()

    torch._dynamo.reset()
    fn = torch.compile(rotary, backend=BACKEND)
    with actcore.compress_saved_tensors("G1.2", min_numel=256):
        loss = fn(x, positions)
    loss.backward()
    kept = {shape for shape, how in spy.seen if how.why == "read through sin or cos in backward"}
    assert kept, spy.seen  # (the positions, from which backward recomputes the angles)
    expected = torch.autograd.grad(rotary(x, positions), positions)[0]
    assert F.cosine_similarity(positions.grad, expected, 0) > 0.95


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_convolution_input_is_scaled_per_channel(
    monkeypatch: pytest.MonkeyPatch, layout: torch.memory_format
) -> None:
    """A convolution's input (NCHW, 12 x 12 pixels a channel: its quantization groups span
    two channels; channels last, 16 channels a pixel) is scaled by channel, dim 1: one
    channel 1000x larger no longer sets the rounding step of its neighbours, whose weight
    gradients stay close (the scale broadcast along the channels' dim in memory order)."""
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 8, 3, padding=1)
    x = torch.randn(4, 16, 12, 12)
    x[:, 0] *= 1000
    x = x.contiguous(memory_format=layout)
    exact = torch.autograd.grad(conv(x).square().mean(), conv.weight)[0]
    model = actcore.convert(_Wrapped(copy.deepcopy(conv)), "L3")
    torch._dynamo.reset()
    torch.compile(model, backend=BACKEND, fullgraph=True)(x).square().mean().backward()
    packed = [how for shape, how in spy.seen if shape == (4, 16, 12, 12)]
    assert packed and {how.channel_dim for how in packed} == {1}, packed
    grad = model.inner.weight.grad
    cosine = F.cosine_similarity(grad[:, 1:].flatten(), exact[:, 1:].flatten(), 0)
    assert cosine > 0.6, cosine  # (2 bits: 0.79; scaled along the last dim, pixels: 0.04)


class _PythonRMSNorm(nn.Module):
    """An RMS norm written in Python (as Hugging Face's Llama writes its own)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _NormMLP(nn.Module):
    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm(64), nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.down(F.silu(self.up(self.norm(x))))).square().mean()


@pytest.mark.parametrize("kind", ["python", "torch", "layer"])
def test_a_recomputed_norm_keeps_its_statistics_exact(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A converted norm recomputed in backward saves its statistics (an RMS norm's means of
    squares) exactly, so backward normalizes the packed input by the forward's own
    statistics and the input takes the level's row-norm bits. A fused layer norm, which
    backward replays whole from its input, statistics included, keeps that input at
    RECOMPUTED_STATISTICS_BITS."""
    norms = {"python": _PythonRMSNorm, "torch": lambda d: nn.RMSNorm(d, eps=1e-6)}
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    model = actcore.convert(_NormMLP(norms.get(kind, nn.LayerNorm)), "L3")
    torch._dynamo.reset()
    torch.compile(model, backend=BACKEND, fullgraph=True)(torch.randn(8, 64, 64)).backward()
    norm_inputs = {how.bits for _, how in spy.seen if how.why == "a row_norm input"}
    statistics = {how.kind for shape, how in spy.seen if shape == (8, 64, 1)}
    if kind == "layer":
        assert norm_inputs == {RECOMPUTED_STATISTICS_BITS}, spy.seen
    else:
        assert norm_inputs == {ROW_NORM_BITS} and ROW_NORM_BITS < RECOMPUTED_STATISTICS_BITS
        assert statistics == {"keep"}, spy.seen  # the mean of squares, exact


def test_what_a_norm_takes_statistics_of_in_backward_keeps_more_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under inductor's decompositions and partitioner, a ViT's backward replays its first
    layer norm from the saved token sequence plus the position embedding: that sequence is
    read nonlinearly through an add, and a variance of it at 4 bits would hold the rounding
    noise (gradient cosine 0.75 under inductor). It takes RECOMPUTED_STATISTICS_BITS, as
    the norms' own inputs do."""
    spy = _Spy(monkeypatch)
    base, args, loss = MODELS["vit"]()
    plain = copy.deepcopy(base)
    exact = _step(plain, plain, args, loss)
    model = actcore.convert(copy.deepcopy(base), "L3")
    torch._dynamo.reset()
    fn = torch.compile(model, backend="aot_eager_decomp_partition")
    cosine = F.cosine_similarity(_step(model, fn, args, loss), exact, 0).item()
    tokens = [how for shape, how in spy.seen if shape == (8, 17, 64)]  # (batch, tokens, width)
    assert {how.bits for how in tokens} == {RECOMPUTED_STATISTICS_BITS}, tokens
    assert "a norm's statistics recomputed from it" in {how.why for how in tokens}, tokens
    assert cosine > 0.97, cosine


def test_a_norm_output_is_recomputed_not_packed_beside_its_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Traced inside a scope, a converted norm (torch's or a Python-written one) runs in a
    non-reentrant checkpoint: the compiled graph packs its input once and backward
    recomputes its output, which the products after it read, instead of packing that too."""
    x = torch.randn(8, 64, 64)
    held, forward = {}, {}
    for name, norm in (("torch", lambda d: nn.RMSNorm(d, eps=1e-6)), ("python", _PythonRMSNorm)):
        torch.manual_seed(0)
        model = actcore.convert(_NormMLP(norm), "L3")
        assert model.norm.act_recompute_output
        torch._dynamo.reset()
        fn = torch.compile(model, backend=BACKEND, fullgraph=True)
        fn(x).backward()
        forward[name], held[name] = profiled_bytes(lambda fn=fn: fn(x))
        torch._dynamo.reset()
        monkeypatch.setattr(type(model.norm), "act_recompute_output", False)
        fn = torch.compile(model, backend=BACKEND, fullgraph=True)
        fn(x).backward()
        both = profiled_bytes(lambda fn=fn: fn(x))[1]
        monkeypatch.undo()
        # the norm's output (64 x 8 x 64 values, packed at the row-norm bits) comes on top
        assert both - held[name] >= x.numel() * ROW_NORM_BITS / 8 * 0.9, (both, held)
    assert held["torch"] == held["python"]
    assert torch.equal(forward["torch"], forward["python"])


class _SwiGLU(nn.Module):
    """A Llama MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(64, 256, bias=False), nn.Linear(64, 256, bias=False)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x)).square().mean()


def _saved_by_min_cut(fn: Callable, args: tuple, mark: bool) -> list[str]:
    """The forward values the min-cut partitioner saves for ``fn``'s backward, with the
    joint graph first passed through ``recompute_from_saved`` if ``mark``."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved: list[str] = []

    def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        if mark:
            partition_pass.recompute_from_saved(joint.graph)
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        saved.extend(n.name for n in bw.graph.find_nodes(op="placeholder"))
        return fw, bw

    compiled_fn = aot_function(
        fn, lambda gm, _: make_boxed_func(gm.forward), partition_fn=partition
    )
    compiled_fn(*args).backward()
    return [n for n in saved if not n.startswith(("primals", "tangents"))]


def test_a_product_of_saved_tensors_is_recomputed_not_saved() -> None:
    """The min-cut partitioner saves SwiGLU's ``silu(gate) * up`` beside ``gate`` and
    ``up`` (the down projection's weight gradient reads it); marked by the pass, backward
    rebuilds it from them."""
    args = tuple(torch.randn(*s, requires_grad=True) for s in ((32, 64), (64, 256), (64, 256)))

    def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ((F.silu(x @ gate) * (x @ up)) @ up.t()).square().sum()

    plain = _saved_by_min_cut(mlp, args, mark=False)
    marked = _saved_by_min_cut(mlp, args, mark=True)
    assert len(marked) == len(plain) - 1, (plain, marked)
    assert set(marked) < set(plain), (plain, marked)


def test_inductor_packs_swiglu_operands_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled by inductor, a converted SwiGLU MLP packs gate and up only (at the activation
    bits), not their product beside them at the product inputs' 2 bits: the down
    projection's weight gradient comes out as close as the others. Inductor's
    ``joint_custom_pre_pass`` is the user's again after the step, their pass having run."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        calls = 0

        def __call__(self, graph: torch.fx.Graph) -> None:
            UserPass.calls += 1

        def uuid(self) -> Any:
            return "test-user-pass"

    user = UserPass()
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    base, x = _SwiGLU(), torch.randn(4, 32, 64)
    plain = copy.deepcopy(base)
    plain(x).backward()
    model = actcore.convert(copy.deepcopy(base), "L3")
    torch._dynamo.reset()
    # (torch's own patch: pytest's monkeypatch would delete the config entry on undo)
    with inductor_config.patch(joint_custom_pre_pass=user):
        torch.compile(model, fullgraph=True)(x).backward()
        assert inductor_config.joint_custom_pre_pass is user and UserPass.calls >= 1
    hidden = {how.why for shape, how in spy.seen if math.prod(shape) == 4 * 32 * 256}
    assert "a product input" not in hidden, spy.seen
    cosines = {
        name: F.cosine_similarity(
            p.grad.flatten(), dict(plain.named_parameters())[name].grad.flatten(), 0
        ).item()
        for name, p in model.named_parameters()
    }
    assert cosines["down.weight"] > 0.95, cosines


def _on_two_ranks(worker: Callable[[int, int, str, str], None]) -> list[Any]:
    """What ``worker(rank, world, init_file, out_dir)`` saved as ``rank{rank}.pt`` on each of
    two spawned gloo processes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


def _small_convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 16 * 16, 10),
    )  # fmt: skip


def _compiled_ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(5)).chunk(world)[rank]
        results = {}
        for name in ("plain", "act"):
            model = _small_convnet()
            if name == "act":
                actcore.convert(model, "L3")
            torch._dynamo.reset()
            fn = torch.compile(nn.parallel.DistributedDataParallel(model), backend=BACKEND)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                out = fn(x)
                out.square().mean().backward()
            results[name] = out.detach(), _grads(model).double()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_compiled_ddp_with_two_gloo_processes() -> None:
    """A converted model in DistributedDataParallel, compiled, on two gloo ranks: each rank's
    forward is the compiled plain one's, both ranks hold the same averaged gradients, close
    to the plain model's."""
    ranks = _on_two_ranks(_compiled_ddp_worker)
    for results in ranks:
        assert torch.equal(results["act"][0], results["plain"][0])
    assert torch.equal(ranks[0]["act"][1], ranks[1]["act"][1])
    # measured 0.962 on this seed (2026-11-29): one step at L3, batch 4 a rank
    assert F.cosine_similarity(ranks[0]["act"][1], ranks[0]["plain"][1], 0) > 0.9


def _compiled_fsdp2_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(5)).chunk(world)[rank]
        results = {}
        for name in ("plain", "act"):
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)
            )
            if name == "act":
                actcore.convert(model, "L3")
            for layer in (model[0], model[2], model[4]):
                fully_shard(layer)
            fully_shard(model)
            torch._dynamo.reset()
            fn = torch.compile(model, backend=BACKEND)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                out = fn(x)
                out.square().mean().backward()
            held = profiled_bytes(lambda fn=fn: fn(x))[1]
            grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
            results[name] = out.detach(), grads.double(), held
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # (both ranks done before either tears the group down)
    finally:
        dist.destroy_process_group()


def test_compiled_fsdp2_with_two_gloo_processes() -> None:
    """A converted model sharded by FSDP2 (``fully_shard``), compiled, on two gloo ranks: the
    compiled plain forward, the same gradients on both ranks, close to the plain model's,
    and fewer bytes kept (parameters all-gathered stay exact: they are never packed)."""
    ranks = _on_two_ranks(_compiled_fsdp2_worker)
    for results in ranks:
        assert torch.equal(results["act"][0], results["plain"][0])
        assert results["plain"][2] > 2 * results["act"][2], (results["plain"][2], results["act"][2])
    assert torch.equal(ranks[0]["act"][1], ranks[1]["act"][1])
    # measured 0.997 on this seed, 4.6x fewer bytes (2026-11-29)
    assert F.cosine_similarity(ranks[0]["act"][1], ranks[0]["plain"][1], 0) > 0.9
