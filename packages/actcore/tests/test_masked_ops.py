"""Tests of actcore.ops' masked ops (zero-value compression): masked quantize and
dequantize, apply_mask, bad masks, opcheck."""

from __future__ import annotations

import math

import pytest
import torch

from actcore import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _relu_and_mask(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.relu(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))
    return x, ops.pack_mask(x != 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_quantize_is_quantize_of_the_selected_values(dtype):
    x, mask = _relu_and_mask(3, 5, 70)
    x = x.to(dtype)
    payload, lo, step = ops.masked_quantize(x, mask, 3, group_size=32, seed=17)
    plain = ops.quantize(x[x != 0], 3, group_size=32, seed=17, per_sample=False)
    for a, b in zip((payload, lo, step), plain.tensors(), strict=True):
        assert torch.equal(a, b)
    y = ops.masked_dequantize(payload, lo, step, mask, 3, 32, x.shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y == 0, x == 0)  # the zeros are exact, the rest within one step
    assert torch.equal(y[x != 0], ops.dequantize(plain))
    assert torch.all(y[x == 0].view(torch.int8 if dtype == torch.float64 else torch.uint8) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_quantize_padded_is_masked_quantize_in_larger_buffers(dtype):
    x, mask = _relu_and_mask(3, 5, 70)
    x = x.to(dtype)
    exact = ops.masked_quantize(x, mask, 3, group_size=32, seed=17)
    *padded, count = ops.masked_quantize_padded(x, mask, 3, group_size=32, seed=17)
    assert count.dtype == torch.int64 and count.shape == () and int(count) == (x != 0).sum()
    assert padded[0].shape == (1, (x.numel() + 7) // 8 * 3)
    assert padded[1].shape == padded[2].shape == (1, -(-x.numel() // 32))
    for a, b in zip(exact, padded, strict=True):
        assert torch.equal(b[:, : a.shape[1]], a) and not b[:, a.shape[1] :].any()
    back = ops.masked_dequantize(*padded, mask, 3, 32, x.shape, dtype)
    assert torch.equal(back, ops.masked_dequantize(*exact, mask, 3, 32, x.shape, dtype))
    # the Python reference (no native kernels) reads the larger buffers too
    from actcore.ops.masked import masked_dequantize_reference

    ref = masked_dequantize_reference(*padded, mask, 3, 32, list(x.shape), dtype)
    assert torch.equal(ref, back)


def test_masked_ops_on_empty_and_all_zero_tensors():
    for x in (torch.zeros(0, 4), torch.zeros(3, 40)):
        mask = ops.pack_mask(x != 0)
        payload, lo, step = ops.masked_quantize(x, mask, 2, seed=1)
        assert payload.shape == (1, 0) and lo.shape == (1, 0)
        y = ops.masked_dequantize(payload, lo, step, mask, 2, 256, x.shape, x.dtype)
        assert torch.equal(y, x)
        *padded, count = ops.masked_quantize_padded(x, mask, 2, seed=1)
        assert int(count) == 0
        assert torch.equal(ops.masked_dequantize(*padded, mask, 2, 256, x.shape, x.dtype), x)


def test_apply_mask_is_where():
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(4, 7, 9, generator=g)
    grad[0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    keep = torch.rand(4, 7, 9, generator=g) > 0.4
    keep[0, 0, 0] = True  # a NaN passes where the mask is set, and is dropped where it is not
    grad[1, 1, :2] = math.nan
    keep[1, 1, :2] = False
    out = ops.apply_mask(grad.transpose(1, 2), ops.pack_mask(keep.transpose(1, 2).contiguous()))
    expected = torch.where(keep.transpose(1, 2), grad.transpose(1, 2), 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert out.is_contiguous() and out.isnan().sum() == 1


def test_masked_ops_refuse_bad_masks():
    x, mask = _relu_and_mask(2, 30)
    with pytest.raises(TypeError, match="packed 1-bit mask"):
        ops.masked_quantize(x, x != 0, 2)
    with pytest.raises(ValueError, match="over 60 elements takes 8 bytes, got 7"):
        ops.masked_quantize(x, mask[:7], 2)
    with pytest.raises(ValueError, match="masked_quantize_padded: a mask over 60 elements"):
        ops.masked_quantize_padded(x, mask[:7], 2)
    with pytest.raises(TypeError, match="floating"):
        ops.apply_mask(x.int(), mask)


def _masked_opcheck_cases():
    x, mask = _relu_and_mask(3, 70)
    payload, lo, step = torch.ops.actcore.masked_quantize(x, mask, 2, 16, True, 4)
    return [
        (torch.ops.actcore.masked_quantize.default, (x, mask, 2, 16, True, 4)),
        (torch.ops.actcore.masked_quantize.default, (x.t().half(), mask, 4, 8, False, 0)),
        (
            torch.ops.actcore.masked_dequantize.default,
            (payload, lo, step, mask, 2, 16, [3, 70], torch.float32),
        ),
        (torch.ops.actcore.apply_mask.default, (torch.randn(3, 70), mask)),
        (torch.ops.actcore.masked_quantize_padded.default, (x, mask, 2, 16, True, 4)),
    ]


@pytest.mark.parametrize("case", range(5))
def test_masked_opcheck(case):
    op, args = _masked_opcheck_cases()[case]
    torch.library.opcheck(op, args)
