"""Levels L1-L5 and swap: unbiased gradients, memory, training accuracy, DDP, L3.1, L4.

Statistical tests use fixed seeds and bounds from the quantizer's own guarantee: stochastic
rounding with step ``s`` adds independent zero-mean errors of variance at most ``s^2 / 4``
per element, and a group's step is at most its range over ``2^bits - 1`` (times the bfloat16
rounding of the stored step, at most ``1 + 2^-7``).
"""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import forward_backward
from torch import nn

import actcore
from actcore import memory, ops
from actcore.config import LEVELS, config

EPOCHS = 5
STEP_SLACK = 1.02  # bfloat16 rounding of the stored step (up), and of the group minimum
SIGMAS = 5.0  # per-element tolerance in standard deviations (upper-bounded variance)


def _per_sample_step(x: torch.Tensor, bits: int) -> torch.Tensor:
    """An upper bound of the quantization step of each sample's groups (shape [N])."""
    flat = x.detach().reshape(x.shape[0], -1)
    return (flat.amax(1) - flat.amin(1)) * STEP_SLACK / (2**bits - 1)


def _mean_gradient(
    layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over ``n`` fresh rounding seeds of the weight gradient of ``sum(layer(x) * w)``,
    and one single-seed gradient."""
    total, first = None, None
    for _ in range(n):
        layer.zero_grad()
        (layer(x) * weight).sum().backward()
        g = layer.weight.grad.detach().clone()
        first = g if first is None else first
        total = g if total is None else total + g
    return total / n, first


def _assert_unbiased(mean, single, exact, var_bound, n):
    sigma = (var_bound / n).sqrt()
    err = (mean - exact).abs()
    assert (single - exact).abs().max() > 0, "no rounding noise: nothing was compressed"
    worst = (err / sigma.clamp_min(1e-30)).max().item()
    assert worst < SIGMAS, f"mean gradient is {worst:.1f} bound-sigmas from the exact one"
    # the noise of one step is real, and averaging shrinks it (unbiased, not just small)
    assert err.norm() < (single - exact).norm() / math.sqrt(n) * 3


@pytest.mark.parametrize("level, bits", [("L1", 4), ("L3", 2)])
def test_linear_gradient_unbiased(level: str, bits: int) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(64, 8)
    q = actcore.convert(copy.deepcopy(ref), level=level)
    q.act_scheme = None  # fixed bits: the bound below is for `bits` exactly
    x = torch.randn(32, 64) * torch.linspace(0.1, 3, 32)[:, None]  # heterogeneous samples
    x.requires_grad_(True)
    w = torch.randn(32, 8)
    (ref(x) * w).sum().backward()
    n = 120
    mean, single = _mean_gradient(q, x, w, n)
    step = _per_sample_step(x, bits)  # grad_W = w^T x_hat: Var <= sum_n w[n,o]^2 s_n^2 / 4
    var = (w.square() * (step.square() / 4)[:, None]).sum(0)[:, None].expand(8, 64)
    _assert_unbiased(mean, single, ref.weight.grad, var, n)


def test_conv_after_relu_gradient_unbiased_l3() -> None:
    """L3's zero-value path: conv input is a ReLU output stored as mask + 2-bit nonzeros."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1))
    q = actcore.convert(copy.deepcopy(ref), level="L3")
    q[1].act_scheme = None
    x = torch.randn(4, 4, 8, 8, requires_grad=True)
    w = torch.randn(4, 6, 8, 8)
    (ref(x) * w).sum().backward()
    n = 120
    total, single = 0, None
    for _ in range(n):
        q.zero_grad()
        (q(x) * w).sum().backward()
        g = q[1].weight.grad.clone()
        single = g if single is None else single
        total = total + g
    # nonzeros are grouped over the flattened tensor: bound every step by the global range
    relu_out = x.detach().relu()
    step = relu_out.max() * STEP_SLACK / 3
    # grad_W[o,c,i,j] = sum_{n,h,w} w[n,o,h,w] x_hat[n,c,h+i,w+j]: each x element at most once
    var = (w.square().sum((0, 2, 3)) * step**2 / 4)[:, None, None, None].expand(6, 4, 3, 3)
    _assert_unbiased(total / n, single, ref[1].weight.grad, var, n)


@pytest.mark.parametrize("kind", ["bn", "ln"])
def test_norm_weight_gradient_unbiased_l2(kind: str) -> None:
    """grad of a norm's weight is sum(grad * x_hat), x_hat quantized per sample at 4 bits."""
    torch.manual_seed(0)
    if kind == "bn":
        ref, x = nn.BatchNorm1d(16), torch.randn(64, 16, 4)
        dims, x_hat = (0, 2), None
    else:
        ref, x = nn.LayerNorm(64), torch.randn(16, 64) * 3 + 1
        dims = (0,)
    x = x * torch.linspace(0.1, 5, x.shape[1]).view(1, -1, *([1] * (x.dim() - 2)))
    if kind == "bn":
        mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    else:
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    x_hat = (x - mean) / (var + ref.eps).sqrt()
    q = actcore.convert(copy.deepcopy(ref), level="L2")
    x.requires_grad_(True)
    w = torch.randn(x.shape)
    (ref(x) * w).sum().backward()
    n = 120
    mean_g, single = _mean_gradient(q, x, w, n)
    step = _per_sample_step(x_hat, 4)
    sw = w.square() * (step.square() / 4).view(-1, *([1] * (x.dim() - 1)))
    var = sw.sum(dims)
    _assert_unbiased(mean_g, single, ref.weight.grad, var, n)


@pytest.mark.parametrize("kind", ["bn", "ln", "gn"])
def test_norm_with_tiny_channel_variance_stays_accurate(kind: str) -> None:
    """A channel with a large offset and a tiny spread: quantizing the raw input per sample
    would make its rounding error thousands of times its spread, and invstd would blow the
    gradient up; the normalized input keeps the error relative to the spread."""
    torch.manual_seed(0)
    x = torch.randn(8, 6, 5, 5)
    x[:, 0] = 100 + 1e-3 * x[:, 0]
    if kind == "ln":
        ref, x = nn.LayerNorm(25), x.flatten(2)
        x[:, :, 0] = 1e3
    else:
        ref = nn.BatchNorm2d(6) if kind == "bn" else nn.GroupNorm(6, 6)
    x.requires_grad_(True)
    w = torch.randn(x.shape)
    (ref(x) * w).sum().backward()
    q = actcore.convert(copy.deepcopy(ref), level="L2")
    xq = x.detach().clone().requires_grad_(True)
    (q(xq) * w).sum().backward()
    # 4-bit noise on unit-spread values: errors well below the gradient itself (the raw
    # input's per-sample step would be ~100 / 15 against a spread of 1e-3 in channel 0)
    for a, b in ((xq.grad, x.grad), (q.weight.grad, ref.weight.grad)):
        assert ((a - b).norm() / b.norm()) < 0.6
    torch.testing.assert_close(q.bias.grad, ref.bias.grad)  # sum(grad): no x involved


# --- L3.1, L4, swap: what they change and what they keep ------------------------------------


def _small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def _seeded_grads(model: nn.Module, x: torch.Tensor, seed: int = 3) -> list[torch.Tensor]:
    ops.reset_seed_stream()
    return forward_backward(model, x, seed=seed)[1]


def test_micro_batched_conv_backward_l3_1() -> None:
    """L3.1 splits conv backward into micro-batches: the same gradients as L3 (same seeds)."""
    x = torch.randn(8, 3, 8, 8)
    l3 = _seeded_grads(actcore.convert(_small_cnn(), level="L3"), x)
    l31 = _seeded_grads(actcore.convert(_small_cnn(), level="L3.1"), x)
    assert LEVELS["L3.1"].micro_batches > 1
    for a, b in zip(l3, l31, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # only summation order differs


@pytest.mark.parametrize("level, same_as", [("L4", "L3"), ("L5", "L3"), ("swap", "L0")])
def test_swap_levels_on_cpu_are_their_base_level(level: str, same_as: str) -> None:
    """On CPU there is nowhere to swap to: L4/L5 keep L3's bytes and gradients, swap L0's."""
    x = torch.randn(4, 3, 8, 8)
    got = _seeded_grads(actcore.convert(_small_cnn(), level=level), x)
    want = _seeded_grads(actcore.convert(_small_cnn(), level=same_as), x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    sizes = []
    for lv in (level, same_as):
        model = actcore.convert(_small_cnn(), level=lv)
        with memory.track(model) as report:
            out = model(x)
        sizes.append(report.retained_bytes)
        del out
    assert sizes[0] == sizes[1]


def test_levels_order_memory() -> None:
    """Each level keeps no more than the one before it on a conv-BN-ReLU net."""
    x = torch.randn(8, 3, 8, 8)
    sizes = {}
    for level in ("L0", "L1", "L2", "L3"):
        model = actcore.convert(_small_cnn(), level=level)
        with memory.track(model) as report:
            out = model(x)
        sizes[level] = report.retained_bytes
        del out
    assert sizes["L0"] > sizes["L1"] > sizes["L2"] > sizes["L3"]


# --- ResNet-50 memory ------------------------------------------------------------------------


def test_resnet50_l3_keeps_14x_fewer_bytes() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    x = torch.randn(8, 3, 224, 224)
    with memory.track(model) as report:
        out = model(x)
    fp32 = report.retained_bytes
    del out
    actcore.convert(model, level="L3")
    with memory.track(model) as report:
        out = model(x)
    l3 = report.retained_bytes
    del out
    assert fp32 > 600 * 2**20
    assert fp32 / l3 >= 14.0, f"L3 keeps {l3 / 2**20:.1f} MiB, fp32 {fp32 / 2**20:.1f} MiB"


# --- 2-bit training on sklearn's digits ------------------------------------------------------


def _digits_accuracy(level: str | None, data) -> float:
    xtr, ytr, xte, yte = data
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    )
    if level is not None:
        actcore.convert(model, level=level)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    ops.reset_seed_stream()
    for _ in range(EPOCHS):
        for idx in torch.randperm(len(xtr), generator=gen).split(128):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item() * 100


def test_two_bit_training_matches_fp32_on_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(x))
    data = (x[perm[:split]], y[perm[:split]], x[perm[split:]], y[perm[split:]])
    fp32 = _digits_accuracy(None, data)
    two_bit = _digits_accuracy("L3", data)
    assert fp32 > 95.0
    assert two_bit >= fp32 - 1.0, f"L3 {two_bit:.2f}% vs fp32 {fp32:.2f}%"


# --- DDP with QSyncBatchNorm on gloo ---------------------------------------------------------


def _sync_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.SyncBatchNorm(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 2),
    )


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str, level: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # DDP refuses every SyncBatchNorm instance on CPU, as torch's own has no CPU kernel;
    # QSyncBatchNorm synchronises through collectives, so that check is lifted here
    nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, m: None
    try:
        model = actcore.convert(_sync_model(), level=level)
        ddp = nn.parallel.DistributedDataParallel(model)
        x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(5))
        part = x.chunk(world)[rank]
        out = ddp(part)
        out.square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        torch.save(
            {"out": out.detach(), "grads": grads, "state": model.state_dict()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("level", ["L0", "L2"])
def test_ddp_gloo_qsyncbatchnorm_matches_full_batch(level: str) -> None:
    """Two ranks with half the batch each give the full-batch single-process step."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_ddp_worker, args=(world, init_file, tmp, level), nprocs=world, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    ref = _sync_model()
    ref[1] = nn.BatchNorm2d(4)  # plain batch norm over the whole batch, same init
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(5))
    out = ref(x)
    out.square().mean().backward()
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), out.detach())
    for r in results:  # DDP leaves the same averaged gradients on every rank
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, msg=key)
        for g, p in zip(r["grads"], ref.parameters(), strict=True):
            if level == "L0":
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
            elif p.grad.norm() > 1e-4:  # 4-bit inputs: close (conv bias before BN: grad 0)
                assert torch.nn.functional.cosine_similarity(g.flatten(), p.grad.flatten(), 0) > 0.9
    for a, b in zip(results[0]["grads"], results[1]["grads"], strict=True):
        assert torch.equal(a, b)


def test_qsyncbatchnorm_single_process_is_batchnorm() -> None:
    """Without a process group QSyncBatchNorm computes what torch's SyncBatchNorm does."""
    assert not dist.is_initialized()
    ref = nn.SyncBatchNorm(5)
    q = actcore.convert(nn.Sequential(copy.deepcopy(ref)), level="L0")[0]
    assert type(q) is actcore.QSyncBatchNorm and isinstance(q, nn.SyncBatchNorm)
    x = torch.randn(4, 5, 3, 3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_q = ref(xa), q(xb)
    assert torch.equal(out_ref, out_q)
    out_ref.square().sum().backward()
    out_q.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(ref.weight.grad, q.weight.grad)
    assert torch.equal(ref.running_var, q.running_var)


@pytest.fixture(autouse=True)
def _restore_config():
    saved = (config.level, config.min_numel)
    yield
    config.level, config.min_numel = saved
