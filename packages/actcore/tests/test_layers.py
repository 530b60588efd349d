"""Q-layers against their torch layers: same forward bits, same gradients at L0, same API.

Every case builds a torch layer, a converted deep copy, and feeds both the same input in
training mode with ``requires_grad`` (so the Q-layer takes its compressing path; the
fixture lowers ``config.min_numel`` so even these small tensors are compressed).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from conftest import forward_backward
from torch import nn

import actcore
from actcore import memory, ops

LEVELS = ("L0", "L1", "L2", "L3")


pytestmark = pytest.mark.usefixtures("small_tensors")


# name -> (factory of the torch layer, input shape); input of a layer is N(0, 1) data
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 40)),
    "conv1d_circular": (lambda: nn.Conv1d(4, 4, 3, padding=2, padding_mode="circular"), (2, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 6, 3, stride=2, padding=1), (2, 3, 11, 9)),
    "conv2d_groups_dilation": (
        lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, bias=False),
        (2, 4, 8, 8),
    ),
    "conv2d_reflect_same": (
        lambda: nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"),
        (2, 3, 7, 7),
    ),
    "conv2d_valid": (lambda: nn.Conv2d(3, 4, (3, 1), padding="valid"), (2, 3, 7, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 2, 5, 5, 5)),
    "convT1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1), (2, 3, 10)),
    "convT2d": (
        lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, groups=2, dilation=1),
        (2, 4, 6, 6),
    ),
    "convT3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 2, 3, 3, 3)),
    "linear": (lambda: nn.Linear(20, 7), (3, 5, 20)),
    "linear_nobias": (lambda: nn.Linear(20, 7, bias=False), (6, 20)),
    "bn1d_2d": (lambda: nn.BatchNorm1d(5), (16, 5)),
    "bn1d_3d": (lambda: nn.BatchNorm1d(4, momentum=None), (3, 4, 10)),
    "bn2d": (lambda: nn.BatchNorm2d(4), (3, 4, 6, 6)),
    "bn2d_no_affine": (lambda: nn.BatchNorm2d(4, affine=False), (3, 4, 5, 5)),
    "bn2d_no_running": (lambda: nn.BatchNorm2d(4, track_running_stats=False), (3, 4, 5, 5)),
    "bn3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 4, 4)),
    "layernorm": (lambda: nn.LayerNorm(12), (4, 6, 12)),
    "layernorm_2d_noaffine": (lambda: nn.LayerNorm((6, 12), elementwise_affine=False), (4, 6, 12)),
    "groupnorm": (lambda: nn.GroupNorm(2, 6), (3, 6, 5, 5)),
    "relu": (lambda: nn.ReLU(), (4, 50)),
    "relu_inplace": (lambda: nn.ReLU(inplace=True), (4, 50)),
    "leaky_relu": (lambda: nn.LeakyReLU(0.2), (4, 50)),
    "relu6": (lambda: nn.ReLU6(inplace=True), (4, 50)),
    "hardtanh": (lambda: nn.Hardtanh(-0.5, 0.7), (4, 50)),
    "maxpool1d": (lambda: nn.MaxPool1d(3, stride=2, padding=1), (2, 3, 21)),
    "maxpool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 3, 9, 9)),
    "maxpool2d_ceil_dilation": (
        lambda: nn.MaxPool2d(2, stride=2, dilation=2, ceil_mode=True),
        (2, 3, 9, 8),
    ),
    "maxpool3d": (lambda: nn.MaxPool3d(2), (2, 2, 4, 6, 4)),
    "maxpool2d_big_window": (lambda: nn.MaxPool2d(17, stride=1), (1, 1, 20, 20)),
    "avgpool1d": (lambda: nn.AvgPool1d(3, stride=2, padding=1), (2, 3, 21)),
    "avgpool2d": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        (2, 3, 9, 9),
    ),
    "avgpool2d_divisor": (lambda: nn.AvgPool2d(2, divisor_override=3), (2, 3, 8, 8)),
    "avgpool3d": (lambda: nn.AvgPool3d(2), (2, 2, 4, 4, 4)),
    "dropout": (lambda: nn.Dropout(0.3), (8, 64)),
    "dropout_inplace": (lambda: nn.Dropout(0.5, inplace=True), (8, 64)),
}

# Layers that keep only exact data (masks, argmax offsets, nothing): gradients are bitwise
# those of torch at every level.
EXACT = ("relu", "leaky", "relu6", "hardtanh", "maxpool", "avgpool", "dropout")


def _pair(name: str, level: str, dtype: torch.dtype = torch.float32):
    factory, shape = CASES[name]
    torch.manual_seed(0)
    ref = factory().to(dtype)
    q = actcore.convert(copy.deepcopy(ref), level=level)
    return ref, q, shape


def _run(layer: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (seeded, for dropout) and the input gradient of a fixed random projection."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = layer(x * 1.0)  # a non-leaf input, so in-place layers work
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weight).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", CASES)
def test_forward_bitwise_and_l0_gradients(name: str, level: str) -> None:
    ref, q, shape = _pair(name, level)
    assert type(q) is not type(ref) and isinstance(q, type(ref))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out_ref, gx_ref = _run(ref, x, seed=3)
    out_q, gx_q = _run(q, x, seed=3)
    assert out_q.dtype == out_ref.dtype and out_q.shape == out_ref.shape
    assert torch.equal(out_q, out_ref), "forward output differs from the torch layer"
    for (key, b_ref), b_q in zip(ref.state_dict().items(), q.state_dict().values(), strict=True):
        assert torch.equal(b_ref, b_q), f"buffer/parameter {key} differs after one step"
    exact = level == "L0" or name.startswith(EXACT)
    if exact:
        assert torch.equal(gx_q, gx_ref)
        for p_ref, p_q in zip(ref.parameters(), q.parameters(), strict=True):
            assert torch.equal(p_q.grad, p_ref.grad)
    else:  # compressed: same shapes, finite, and close (a loose check; bias is tested below)
        assert gx_q.shape == gx_ref.shape and torch.isfinite(gx_q).all()
        for p_ref, p_q in zip(ref.parameters(), q.parameters(), strict=True):
            assert p_q.grad.shape == p_ref.grad.shape and torch.isfinite(p_q.grad).all()


@pytest.mark.parametrize(
    "name", ["conv2d", "convT2d", "linear", "bn2d", "layernorm", "groupnorm", "relu", "maxpool2d"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_bitwise_half(name: str, dtype: torch.dtype) -> None:
    ref, q, shape = _pair(name, "L2", dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    try:
        out_ref, _ = _run(ref, x, seed=3)
    except RuntimeError as e:  # an op this CPU build lacks in this dtype
        pytest.skip(f"torch has no CPU {dtype} kernel: {e}")
    out_q, gx_q = _run(q, x, seed=3)
    assert torch.equal(out_q, out_ref)
    assert gx_q.dtype == dtype and torch.isfinite(gx_q.float()).all()


@pytest.mark.parametrize("name", ["conv2d", "convT2d", "linear", "bn2d", "layernorm", "relu"])
def test_same_api_as_torch(name: str) -> None:
    ref, q, _ = _pair(name, "L2")
    qcls, base = type(q), type(ref)
    assert inspect.signature(qcls.__init__) == inspect.signature(base.__init__)
    assert list(ref.state_dict()) == list(q.state_dict())
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in q.named_parameters()]
    assert [n for n, _ in ref.named_buffers()] == [n for n, _ in q.named_buffers()]
    # constructed directly with the torch constructor's arguments: the same keys and init
    torch.manual_seed(0)
    direct = qcls(*_ctor_args(ref))
    torch.manual_seed(0)
    plain = base(*_ctor_args(ref))
    for (k, a), (k2, b) in zip(
        plain.state_dict().items(), direct.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b)


def _ctor_args(m: nn.Module) -> tuple:
    if isinstance(m, nn.modules.conv._ConvNd):
        return (m.in_channels, m.out_channels, m.kernel_size)
    if isinstance(m, nn.Linear):
        return (m.in_features, m.out_features)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return (m.num_features,)
    if isinstance(m, nn.LayerNorm):
        return (m.normalized_shape,)
    return ()


def test_q_layer_constructed_directly() -> None:
    """A Q-layer built by its own constructor is the torch layer with the same init."""
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 4, 3, padding=1)
    torch.manual_seed(0)
    q = actcore.QConv2d(3, 4, 3, padding=1)
    assert torch.equal(q.weight, ref.weight) and torch.equal(q.bias, ref.bias)
    q.act_level = "L3"
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    assert torch.equal(q(x), ref(x))


# --- in-place ReLU after conv / BN -----------------------------------------------------------


def _conv_bn_relu(inplace: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(8, 4, 1),
    )


def test_inplace_relu_l0_gradients_exact() -> None:
    ref = _conv_bn_relu()
    q = actcore.convert(copy.deepcopy(ref), level="L0")
    x = torch.randn(2, 3, 8, 8)
    for a, b in zip(forward_backward(ref, x)[1], forward_backward(q, x)[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_inplace_relu_compressed_gradients_match_out_of_place(level: str) -> None:
    """In-place and out-of-place ReLU give the same compressed gradients for the same seed."""
    x = torch.randn(2, 3, 8, 8)
    results = []
    for inplace in (True, False):
        model = _conv_bn_relu(inplace)
        actcore.convert(model, level=level)
        torch.manual_seed(5)
        ops.reset_seed_stream()
        results.append(forward_backward(model, x)[1])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["L0", "L2", "L3"])
def test_inplace_relu_memory_not_counted_twice(level: str) -> None:
    """In-place ReLU keeps no more bytes than out-of-place (the mask is stored once)."""
    x = torch.randn(4, 3, 16, 16)
    retained = {}
    for inplace in (True, False):
        model = _conv_bn_relu(inplace)
        actcore.convert(model, level=level)
        with memory.track(model) as report:
            out = model(x.requires_grad_(False))
        retained[inplace] = report.retained_bytes
        out.sum().backward()  # and the graph is usable
    assert retained[True] <= retained[False]


def test_zero_value_shares_relu_mask() -> None:
    """At L3 a conv input that is a ReLU output costs no second mask (storage shared)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(4, 4, 16, 16)
    sizes = {}
    for level in ("L2", "L3"):
        actcore.convert(model, level=level)
        with memory.track(model) as report:
            out = model(x)
        sizes[level] = report.by_module
        del out
    relu_mask = 4 * 8 * 16 * 16 // 8
    # L3 keeps only nonzeros (about half) at 2 bits, L2 all values at 4 bits; the mask
    # itself is the ReLU's and is not counted again under the second conv
    assert sizes["L3"]["2"] < sizes["L2"]["2"] / 3
    assert sizes["L3"]["1"] == sizes["L2"]["1"] == relu_mask


# --- graph reuse, no_grad / eval, autocast, compile ------------------------------------------


@pytest.mark.parametrize("level", ["L0", "L3"])
def test_retain_graph_second_backward_same(level: str) -> None:
    model = actcore.convert(_conv_bn_relu(), level=level)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    loss.backward()
    second = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _forbid_compression(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("compression work on a path that needs no backward")

    for name in ("quantize", "quantize_scaled", "pack_mask", "pack_bits"):
        monkeypatch.setattr(ops, name, refuse)


def _all_layers_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(0.2),
        nn.GroupNorm(2, 8),
        nn.LeakyReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 16),
        nn.LayerNorm(16),
        nn.Hardtanh(),
        nn.Linear(16, 3),
    )


@pytest.mark.parametrize("mode", ["no_grad", "eval_no_grad", "inference_mode", "no_requires_grad"])
def test_no_backward_takes_plain_torch_path(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    ref = _all_layers_model()
    q = actcore.convert(copy.deepcopy(ref), level="L3")
    x = torch.randn(2, 3, 8, 8)
    if mode == "eval_no_grad":
        ref.eval(), q.eval()
    if mode == "no_requires_grad":
        for m in (ref, q):
            m.requires_grad_(False)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    if mode == "no_requires_grad":
        ctx = torch.enable_grad
    torch.manual_seed(1)
    with ctx():
        expected = ref(x)
    _forbid_compression(monkeypatch)
    torch.manual_seed(1)
    with ctx():
        got = q(x)
    assert torch.equal(got, expected)
    for a, b in zip(ref.buffers(), q.buffers(), strict=True):
        assert torch.equal(a, b)


def test_eval_with_grad_is_exact_for_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """In eval mode dropout is the identity: QDropout does no mask work at all."""
    q = actcore.convert(nn.Sequential(nn.Dropout(0.5)), level="L3").eval()
    x = torch.randn(4, 8, requires_grad=True)
    _forbid_compression(monkeypatch)
    assert torch.equal(q(x), x)


def test_bf16_autocast() -> None:
    ref = _all_layers_model()
    q = actcore.convert(copy.deepcopy(ref), level="L0")
    x = torch.randn(2, 3, 8, 8)
    outs, grads = [], []
    for m in (ref, q):
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        outs.append(out)
        out.float().square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # compressed: runs, same forward, finite gradients
    q3 = actcore.convert(copy.deepcopy(ref), level="L3")
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out3 = q3(x)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = copy.deepcopy(ref)(x)
    assert torch.equal(out3, out_ref)
    out3.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in q3.parameters())


@pytest.mark.parametrize("level", ["L0", "L3"])
def test_torch_compile_same_loss_as_eager(level: str) -> None:
    """Compiled (dynamo; graph breaks allowed) and eager give the same loss; at L0 the same
    gradients, at L3 finite ones (their rounding noise draws different seeds)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)
    )
    actcore.convert(model, level=level)
    x = torch.randn(2, 1, 4, 4)
    eager_model = copy.deepcopy(model)
    eager = eager_model(x).square().mean()
    compiled = torch.compile(model, backend="eager")(x).square().mean()
    assert torch.equal(compiled.detach(), eager.detach())
    compiled.backward()
    eager.backward()
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        if level == "L0":
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        else:
            assert a.grad.shape == b.grad.shape and torch.isfinite(a.grad).all()


def test_zero_value_packs_what_quantizing_the_nonzeros_packed() -> None:
    """The fused masked quantizer stores the bytes ``Quantize(x[x != 0])`` stored."""
    from actcore.compressors import Quantize, ZeroValue

    x = torch.relu(torch.randn(4, 8, 9, 9, generator=torch.Generator().manual_seed(4)))
    inner = Quantize(2, 64, per_sample=False)
    ops.reset_seed_stream()
    tensors, meta = ZeroValue(ops.pack_mask(x != 0), inner).pack(x)
    ops.reset_seed_stream()
    plain, _ = inner.pack(x[x != 0])
    assert all(torch.equal(a, b) for a, b in zip(tensors[1:], plain, strict=True))
    y = ZeroValue(tensors[0], inner).unpack(tensors, meta)
    assert torch.equal(y == 0, x == 0) and y.shape == x.shape


def test_batch_norm_backward_from_the_normalized_input() -> None:
    """Training-mode batch-norm backward from x_hat (mean 0, invstd 1, weight * invstd) is the
    backward from x: what the compressed layer hands aten instead of rebuilding x."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, 5, generator=g, dtype=torch.float64) * 3 + 1
    w, b = torch.randn(6, generator=g, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    grad = torch.randn(4, 6, 5, 5, generator=g, dtype=torch.float64)
    _, mean, invstd = aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    x_hat = (x - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)
    mask = [True, True, True]
    ref = aten.native_batch_norm_backward(grad, x, w, None, None, mean, invstd, True, 1e-5, mask)
    ones, zeros = torch.ones_like(invstd), torch.zeros_like(mean)
    got = aten.native_batch_norm_backward(
        grad, x_hat, w * invstd, None, None, zeros, ones, True, 1e-5, mask
    )
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_stash_tells_its_packings_from_what_it_keeps():
    """What a Q-layer saves is marked for the saved-tensor hooks: a packing's own tensors
    (codes, ranges: never a parameter, passed through without looking them up again) apart
    from the tensors kept as they are (the weight), which the hooks still check."""
    from actcore.layers import stash as st
    from actcore.layers.roles import CONV

    model = actcore.convert(nn.Sequential(nn.Linear(64, 64)), level="L3")
    layer = model[0]
    x = torch.randn(32, 64)

    class Ctx:
        def save_for_backward(self, *tensors: torch.Tensor) -> None:
            self.saved = tensors

    ctx = Ctx()
    packed, kept = st.stash(ctx, layer, [(x, CONV), (layer.weight, st.IDENTITY)])
    assert packed.compressor.lossy and len(packed.tensors) >= 3
    assert all(st.stashed_kind(t) == st.PACKED for t in packed.tensors)
    assert [st.stashed_kind(t) for t in kept.tensors] == [st.KEPT]
    assert st.stashed_kind(x) is None and st.is_stashed(layer.weight)
    assert len(ctx.saved) == len(packed.tensors) + 1
