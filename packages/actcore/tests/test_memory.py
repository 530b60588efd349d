"""Tests of actcore.memory: counts checked against hand-computed sizes and the CPU profiler."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import ProfilerActivity, profile

from actcore import memory
from actcore.memory import OUTSIDE, format_bytes, measure, note_outputs, note_saved, track

F32 = 4


def nbytes(t: Tensor) -> int:
    """Bytes of the whole storage behind ``t``."""
    return t.untyped_storage().nbytes()


def conv_bn_relu(inplace: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def saved_by_graph(out: Tensor, exclude: list[Tensor]) -> int:
    """Independent count: the ``_saved_*`` tensors of every node behind ``out``, by storage."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    # The nodes themselves, not their id(): a node's Python wrapper can be freed once
    # popped, and a later node's wrapper can then reuse its id (torch 2.11 does).
    seen: set[Any] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                if isinstance(value, Tensor) and value.untyped_storage().data_ptr() not in skip:
                    storages[value.untyped_storage().data_ptr()] = nbytes(value)
        stack.extend(n for n, _ in node.next_functions)
    return sum(storages.values())


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert memory.saved_hooks.ACTIVE_TRACKERS == []
    assert memory.saved_hooks.hooks_state() == "none"


# ---- 1. hand-computed counts ---------------------------------------------------------------


def test_conv_bn_relu_hand_count() -> None:
    model = conv_bn_relu()
    x = torch.randn(4, 3, 16, 16)
    with track(model) as rep:
        y = model(x)
    # conv saves its input (and its weight, a parameter); batch norm saves its input, weight,
    # running stats (parameter/buffers) and save_mean, save_invstd (8 floats each); relu
    # saves its result.
    conv_in = 4 * 3 * 16 * 16 * F32
    act = 4 * 8 * 16 * 16 * F32
    stats = 2 * 8 * F32
    assert rep.by_module == {"0": conv_in, "1": act + stats, "2": act}
    assert rep.retained_bytes == conv_in + 2 * act + stats == 77888
    assert rep.by_device == {"cpu": 77888}
    assert rep.num_storages == 5 and rep.num_tensors == 5
    assert rep.peak_bytes == rep.saved_bytes == rep.retained_bytes
    assert rep.cuda_peak_delta is None and rep.hooks == "own"
    # Independent check: what the graph's nodes hold, minus parameters and buffers.
    params = [*model.parameters(), *model.buffers()]
    assert saved_by_graph(y, params) == rep.retained_bytes


def test_mlp_hand_count() -> None:
    model = mlp()
    x = torch.randn(8, 16)
    with track(model) as rep:
        y = model(x)
    # linear 0 saves x and weight.t(); relu saves its result, which linear 2 saves again
    # (counted once, for the module that saved it first); the weights are parameters.
    assert rep.by_module == {"0": 8 * 16 * F32, "1": 8 * 32 * F32}
    assert rep.retained_bytes == 1536
    assert rep.num_tensors == 3 and rep.num_storages == 2
    assert saved_by_graph(y, list(model.parameters())) == rep.retained_bytes


# ---- 2. dedup and views --------------------------------------------------------------------


def test_same_tensor_saved_twice_counts_once() -> None:
    x = torch.randn(10, requires_grad=True)
    with track() as rep:
        y = x * x  # mul saves self and other: the same storage
    assert rep.num_tensors == 2 and rep.num_storages == 1
    assert rep.retained_bytes == 10 * F32 and rep.by_module == {"": 10 * F32}
    del y


def test_view_counts_whole_storage() -> None:
    base = torch.randn(100, requires_grad=True)
    with track() as rep:
        v = base[10:12]
        y = v.sin()  # saves the 2-element view, which keeps all 100 floats alive
    assert rep.retained_bytes == 100 * F32
    del y


def test_inplace_relu_after_bn_counts_once() -> None:
    model = conv_bn_relu(inplace=True)
    x = torch.randn(4, 3, 16, 16)
    with track(model) as rep:
        y = model(x)
    # batch norm saves its input (the conv output), not its output; relu_ overwrites the
    # batch-norm output and saves it as its result: one storage, counted once.
    act = 4 * 8 * 16 * 16 * F32
    assert rep.by_module == {"0": 4 * 3 * 16 * 16 * F32, "1": act + 64, "2": act}
    assert rep.num_storages == 5
    assert y.grad_fn.name() == "ReluBackward0"
    assert saved_by_graph(y, [*model.parameters(), *model.buffers()]) == rep.retained_bytes
    y.sum().backward()  # the in-place relu is legal: backward still runs with the tracker


# ---- 3. ctx attributes -----------------------------------------------------------------------


class FakePacked:
    """Stands in for actcore's Packed: a compact handle exposing its tensors()."""

    def __init__(self, x: Tensor) -> None:
        self.codes = (x * 10).round().to(torch.int8)
        self.scale = x.abs().amax().reshape(1)

    def tensors(self) -> tuple[Tensor, Tensor]:
        return self.codes, self.scale


class MaskedScale(torch.autograd.Function):
    """Keeps a uint8 mask, a packed handle and an alias of x as ctx attributes."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.mask = (x > 0).to(torch.uint8)
        ctx.extras = {"packed": FakePacked(x.detach()), "again": [x]}
        ctx.save_for_backward(x)
        return x * ctx.mask * 2

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * ctx.mask * 2 + 0 * x


class Masked(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return MaskedScale.apply(x)


def test_ctx_attributes_counted_once() -> None:
    model = nn.Sequential(nn.Linear(6, 5), Masked())
    x = torch.randn(4, 6)
    with track(model) as rep:
        y = model(x)
    h = 4 * 5  # elements of the linear output, saved by save_for_backward and kept in ctx
    expected_masked = h * F32 + h * 1 + h * 1 + F32  # x, mask, int8 codes, scale
    assert rep.by_module == {"0": 4 * 6 * F32, "1": expected_masked}
    y.sum().backward()
    assert model[0].weight.grad is not None


class PreThenChild(nn.Module):
    """Applies the custom function in its own forward, then calls a child."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.child(MaskedScale.apply(x))


def test_ctx_attribution_to_creating_module_and_outside() -> None:
    model = PreThenChild()
    x = torch.randn(2, 5, requires_grad=True)
    with track(model) as rep:
        y = model(x)
        z = MaskedScale.apply(y)  # outside every tracked module
        note_outputs(z)
    masked = lambda n: n * F32 + n + n + F32  # noqa: E731
    # The parent's node is reached only through the child's graph: its ctx tensors still go
    # to the parent (""), not to the child, which saves its own input (the function's output).
    assert rep.by_module == {"": masked(10), "child": 10 * F32, OUTSIDE: masked(6)}


def test_measure_without_model_walks_outputs() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    out, rep = measure(MaskedScale.apply, x)
    assert rep.retained_bytes == 12 * F32 + 12 + 12 + F32
    assert rep.by_module == {"": rep.retained_bytes}
    out.sum().backward()
    assert torch.equal(x.grad, (x > 0).float() * 2)


# ---- 4. foreign hooks and note_saved ---------------------------------------------------------


def test_note_saved_with_foreign_hooks() -> None:
    unpacked: list[int] = []

    def pack(t: Tensor) -> Tensor:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t  # parameters pass through, as actcore's compressors do
        packed = t.detach().half()
        note_saved(packed)
        return packed

    def unpack(p: Tensor) -> Tensor:
        if p.dtype == torch.float16:
            unpacked.append(1)
        return p.float()

    def grads(tracked: bool) -> tuple[list[Tensor], memory.MemoryReport | None]:
        model = mlp()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        rep = None
        with saved_tensors_hooks(pack, unpack):
            if tracked:
                with track(model) as rep:
                    y = model(x)
            else:
                y = model(x)
        y.square().sum().backward()
        return [p.grad for p in model.parameters()], rep

    g_tracked, rep = grads(True)
    assert rep is not None and rep.hooks == "foreign"
    # fp16 copies: x (8x16), the relu result packed by relu and again by the second linear.
    assert rep.retained_bytes == 8 * 16 * 2 + 2 * 8 * 32 * 2
    assert rep.by_module == {"0": 256, "1": 512, "2": 512}
    assert len(unpacked) == 3  # the user's hooks did the packing, not the tracker's
    g_plain, _ = grads(False)
    assert all(torch.equal(a, b) for a, b in zip(g_tracked, g_plain, strict=True))
    note_saved(torch.ones(3))  # no tracker active: a no-op


def test_hook_probe_for_older_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory.saved_hooks, "_TOP_HOOKS", None)  # as on torch < 2.8
    noted: list[int] = []

    def pack(t: Tensor) -> Tensor:
        noted.append(1)
        note_saved(t)
        return t.detach()

    assert memory.saved_hooks.hooks_state() == "none"
    with track() as rep:
        assert memory.saved_hooks.hooks_state() == "own"
    assert rep.hooks == "own"
    with saved_tensors_hooks(pack, lambda t: t), track() as outer:
        with track() as inner:  # its probe must not reach the outer tracker
            pass
        assert noted and outer.num_tensors == 0
    assert inner.hooks == outer.hooks == "foreign"


# ---- 5. cross-check against the CPU profiler -------------------------------------------------


@pytest.mark.parametrize("make", [conv_bn_relu, mlp], ids=["conv_bn_relu", "mlp"])
def test_profiler_cross_check(make) -> None:
    model = make()
    x = torch.randn(4, 3, 16, 16) if make is conv_bn_relu else torch.randn(8, 16)
    model(x)  # warm-up: lazy one-time allocations stay out of the window
    gc.collect()
    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        track(model) as rep,
    ):
        y = model(x)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events())
    # Allocations minus frees in the window are what the forward left allocated: the saved
    # storages, except the input (allocated before the window, yet saved by the first layer
    # and so counted by the tracker), plus the output when nothing saved it. The tracker
    # itself allocates nothing (the CPU allocator does not cache).
    saved_before = nbytes(x)
    output_unsaved = 0 if make is conv_bn_relu else nbytes(y)
    assert allocated == rep.retained_bytes - saved_before + output_unsaved
    assert allocated > 0


# ---- 6. no effect on results; no_grad; exceptions ---------------------------------------------


def test_gradients_bitwise_equal() -> None:
    base = nn.Sequential(conv_bn_relu(), nn.Flatten(), nn.Linear(8 * 8 * 8, 3))
    base[0].append(nn.MaxPool2d(2))
    x = torch.randn(4, 3, 16, 16)
    results = []
    for tracked in (False, True):
        model = copy.deepcopy(base)
        xi = x.clone().requires_grad_()
        if tracked:
            with track(model) as rep:
                y = model(xi)
            assert rep.retained_bytes > 0
        else:
            y = model(xi)
        y.square().mean().backward()
        results.append([y.detach(), xi.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_double_backward_unchanged() -> None:
    x = torch.randn(6, requires_grad=True)

    def second(tracked: bool) -> Tensor:
        if tracked:
            with track():
                z = (x.tanh() * x).sum()
        else:
            z = (x.tanh() * x).sum()
        (g,) = torch.autograd.grad(z, x, create_graph=True)
        return torch.autograd.grad(g.sum(), x)[0]

    assert torch.equal(second(True), second(False))


def test_inplace_modification_still_raises() -> None:
    x = torch.randn(5, requires_grad=True)
    for tracked in (False, True):
        if tracked:
            with track():
                y = x.sigmoid()  # saves its result
        else:
            y = x.sigmoid()
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_no_grad_records_nothing() -> None:
    model = conv_bn_relu()
    with torch.no_grad(), track(model) as rep:
        model(torch.randn(2, 3, 8, 8))
    assert rep.retained_bytes == rep.num_tensors == rep.peak_bytes == 0
    assert rep.by_module == {}


class Boom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("boom")


def test_exception_removes_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Boom()))
    with pytest.raises(ValueError, match="boom"), track(model):
        model(torch.randn(2, 4))
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    # the autouse fixture also checks that no tracker and no saved-tensor hooks are left


# ---- 7. parameters ---------------------------------------------------------------------------


def test_params_excluded_unless_asked() -> None:
    model = mlp()
    x = torch.randn(8, 16, requires_grad=True)  # so that linear 0 saves its weight too
    with track(model) as rep_default:
        y = model(x)
    with track(model, include_params=True) as rep:
        y2 = model(x)
    with track() as rep_no_model:  # no model: parameters and their views are still skipped
        y3 = model(x)
    w0, w2 = model[0].weight, model[2].weight
    # linear saves weight.t(), a view: the whole weight storage; biases are not saved.
    assert rep.by_module == {"0": 512 + nbytes(w0), "1": 1024, "2": nbytes(w2)}
    assert rep_default.by_module == {"0": 512, "1": 1024}
    assert rep_no_model.by_module == {"": 1536}
    del y, y2, y3


def test_batchnorm_buffers_included_on_request() -> None:
    model = conv_bn_relu()
    with track(model, include_params=True) as rep:
        y = model(torch.randn(2, 3, 8, 8))
    bn = model[1]
    extra_bn = nbytes(bn.weight) + nbytes(bn.running_mean) + nbytes(bn.running_var)
    act = 2 * 8 * 8 * 8 * F32
    assert rep.by_module["1"] == act + 64 + extra_bn
    assert rep.by_module["0"] == 2 * 3 * 8 * 8 * F32 + nbytes(model[0].weight)
    del y


# ---- 8. liveness, nesting, report --------------------------------------------------------------


def test_backward_in_block_releases() -> None:
    model = conv_bn_relu()
    x = torch.randn(2, 3, 8, 8)
    with track(model) as one:
        model(x)  # output dropped: its graph (and what it saved) is freed
    with track(model) as rep:
        for _ in range(2):
            model(x).sum().backward()
    assert one.retained_bytes == 0 and one.peak_bytes == one.saved_bytes > 0
    assert rep.retained_bytes == 0 and rep.by_module == {}
    assert rep.peak_bytes == one.peak_bytes
    assert rep.saved_bytes == 2 * one.saved_bytes


def test_nested_trackers_both_count() -> None:
    model = mlp()
    with track() as outer:
        with track(model) as inner:
            y = model(torch.randn(8, 16))
        z = y * y  # saves y twice: counted once, by the outer tracker only
    assert inner.retained_bytes == 1536 and inner.hooks == outer.hooks == "own"
    assert outer.retained_bytes == 1536 + 8 * 4 * F32
    del z


def test_format_bytes_and_table() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    model = mlp()
    _, rep = measure(model, torch.randn(8, 16))
    text = str(rep)
    assert "0 (Linear)" in text and "1 (ReLU)" in text and "1.50 KiB" in text
    assert text.splitlines()[-1].split()[:3] == ["total", "1.50", "KiB"]


def test_tracker_single_use_and_bad_model() -> None:
    tracker = track()
    with tracker:
        pass
    with pytest.raises(RuntimeError, match="only once"), tracker:
        pass
    with pytest.raises(TypeError, match=r"nn\.Module"):
        track("model")  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_delta() -> None:
    model = conv_bn_relu().cuda()
    x = torch.randn(4, 3, 16, 16, device="cuda")
    with track(model) as rep:
        y = model(x)
    assert rep.retained_bytes == 77888
    # what the forward left allocated (the saved storages except the input) fits in its peak
    assert rep.cuda_peak_delta is not None
    assert rep.cuda_peak_delta >= rep.retained_bytes - nbytes(x)
    del y


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_sparse_tensor_counts_its_indices_and_values(layout: torch.layout) -> None:
    g = torch.Generator().manual_seed(0)
    dense = (torch.rand(500, 400, generator=g) < 0.01) * torch.randn(500, 400, generator=g)
    sparse = dense.to_sparse() if layout == torch.sparse_coo else dense.to_sparse_csr()
    sparse.requires_grad_()
    parts = memory.storage.sparse_parts(sparse.detach())
    expected = sum(p.untyped_storage().nbytes() for p in parts)
    assert expected < dense.nbytes / 10  # far below the dense N x M the old count used
    x = torch.randn(400, 8, requires_grad=True)
    with track() as rep:
        out = torch.mm(sparse, x)  # saves the sparse matrix (for x's grad) and x
    assert rep.retained_bytes == expected + x.nbytes
    del out
