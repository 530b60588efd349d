"""The temporaries of a converted layer at their peak (profiler allocations, CPU).

ACT shrinks what the forward keeps, so the step's peak moves to the transients of one layer:
on an H100, ResNet-50 at batch 512 reached 7.2 GB against 2.8 GB kept after the forward, from
the max-pool's int64 index arithmetic and batch norm's float32 copies of a bf16 input. Each
bound below is in units of one map of the layer's own tensor and fails on those versions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcore
from actcore.adaptive.stats import squared_norm
from actcore.memory import profiled_peak_bytes


def _train_step(model: nn.Module, x: torch.Tensor, bf16: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    out.float().sum().backward()


def test_profiled_peak_bytes_sees_a_freed_temporary() -> None:
    def fn() -> torch.Tensor:
        big = torch.ones(1 << 20)  # 4 MiB, freed before returning
        return big.sum()

    _, peak = profiled_peak_bytes(fn)
    assert 4 << 20 <= peak < 5 << 20


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_max_pool_forward_and_backward_temporaries(level: str) -> None:
    torch.manual_seed(0)
    pool = actcore.convert(nn.Sequential(nn.MaxPool2d(3, stride=2, padding=1)), level=level)
    x = torch.randn(4, 16, 64, 64, requires_grad=True)
    out_numel = 4 * 16 * 32 * 32
    out = pool(x)  # warm
    out.sum().backward()

    _, forward_peak = profiled_peak_bytes(pool, x)
    # its output (fp32), torch's own int64 argmax and two int32 maps while it becomes an
    # offset (before: six int64 maps more)
    assert forward_peak <= out_numel * (4 + 8 + 2 * 4) + (64 << 10)

    out = pool(x)
    grad = torch.ones_like(out)
    _, backward_peak = profiled_peak_bytes(lambda: out.backward(grad))
    # the input's gradient (fp32), the int64 index torch's backward takes, three int32 maps
    # (the offset, one digit and the sum) and the unpacked uint8 offset
    assert backward_peak <= x.numel() * 4 + out_numel * (8 + 3 * 4 + 1) + (64 << 10)


def test_max_pool_gradient_survives_retain_graph() -> None:
    torch.manual_seed(0)
    pool = actcore.convert(nn.Sequential(nn.MaxPool2d(3, stride=2, dilation=2)), level="L3")
    plain = nn.MaxPool2d(3, stride=2, dilation=2)
    x = torch.randn(2, 3, 33, 31, requires_grad=True)
    out = pool(x)
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)
    first = x.grad.clone()
    out.backward(grad)  # the saved offsets must not have been changed in place
    x2 = x.detach().clone().requires_grad_()
    plain(x2).backward(grad)
    torch.testing.assert_close(first, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, 2 * x2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_batch_norm_under_bf16_autocast_makes_no_float32_map(level: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 1), nn.BatchNorm2d(64), nn.Conv2d(64, 4, 1))
    actcore.convert(model, level=level)
    x = torch.randn(8, 64, 32, 32)
    bf16_map = x.numel() * 2
    _train_step(model, x, bf16=True)  # warm
    conv_out = {}

    def keep(module, args, out):  # the batch norm's bf16 input
        conv_out["x"] = out.detach()

    handle = model[0].register_forward_hook(keep)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model[0](x)
    handle.remove()
    bn_in = conv_out["x"].requires_grad_()
    assert bn_in.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, forward_peak = profiled_peak_bytes(model[1], bn_in)
    # its output and the normalized input in bf16 (before: two float32 maps), the packing
    assert forward_peak <= 2.25 * bf16_map + (64 << 10)
    grad = torch.ones_like(out)
    _, backward_peak = profiled_peak_bytes(lambda: out.backward(grad))
    # the unpacked input, the input's gradient and one map of aten's own batch-norm backward
    # (before: three float32 maps on top)
    assert backward_peak <= 3.25 * bf16_map + (64 << 10)


def test_squared_norm_of_bf16_copies_nothing() -> None:
    g = torch.randn(1 << 20).to(torch.bfloat16)
    value, peak = profiled_peak_bytes(squared_norm, g)
    assert peak < 4096  # a float32 copy would take 4 MiB
    exact = g.double().square().sum()
    assert abs(value.double() - exact) <= 2 * 2.0**-8 * exact  # the norm rounded to bf16


def test_squared_norm_keeps_float16_finite() -> None:
    g = torch.full((1 << 12,), 60000.0, dtype=torch.float16)  # norm 3.8e6 > fp16's max
    value = squared_norm(g)
    assert torch.isfinite(value)
    torch.testing.assert_close(value, torch.tensor(60000.0**2 * (1 << 12)), rtol=1e-5, atol=0)


def test_channel_scaled_unpacks_in_place_but_not_into_its_stored_tensor() -> None:
    from actcore.compressors.channel_scaled import ChannelScaled

    class Keep(actcore.compressors.Compressor):  # hands back what it stored
        @property
        def name(self) -> str:
            return "keep"

        @property
        def lossy(self) -> bool:
            return True

        def pack(self, x):
            return (x.clone(),), None

        def unpack(self, tensors, meta):
            return tensors[0]

        def key(self):
            return ("keep",)

    x = torch.randn(64, 8)
    x[:, 3] *= 1000.0  # an outlier channel: scaled by a power of two
    comp = ChannelScaled(Keep(), dim=-1)
    tensors, meta = comp.pack(x)
    stored = tensors[0].clone()
    first = comp.unpack(tensors, meta)
    second = comp.unpack(tensors, meta)
    torch.testing.assert_close(first, x, rtol=0, atol=0)
    torch.testing.assert_close(second, x, rtol=0, atol=0)
    torch.testing.assert_close(tensors[0], stored, rtol=0, atol=0)
