"""Cases shared by the native-kernel tests of every device (test_native*.py)."""

from __future__ import annotations

import pytest
import torch

OPCHECK_CASES = 9


def opcheck_cases(device: str) -> list[tuple[object, tuple]]:
    """(op, args) pairs covering every op, dtypes, layouts and group sizes on ``device``."""
    x = torch.randn(3, 70, device=device)
    payload, lo, step = torch.ops.actcore.quantize(x, 3, 32, True, 5, True)
    values = torch.randint(0, 8, (37,), dtype=torch.uint8, device=device)
    nchw = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    arange = torch.arange(100, device=device)
    return [
        (torch.ops.actcore.quantize.default, (x, 3, 32, True, 5, True)),
        (torch.ops.actcore.quantize.default, (x.half().t(), 2, 8, False, 0, False)),
        (torch.ops.actcore.quantize.default, (x.double()[:, ::2], 8, 512, True, 9, True)),
        (torch.ops.actcore.quantize.default, (nchw.bfloat16(), 1, 24, True, 2, True)),
        (torch.ops.actcore.dequantize.default, (payload, lo, step, 3, 32, [3, 70], x.dtype, True)),
        (torch.ops.actcore.pack_bits.default, (values, 3)),
        (torch.ops.actcore.unpack_bits.default, (torch.ops.actcore.pack_bits(values, 3), 3, 37)),
        (torch.ops.actcore.hash_uniform.default, (arange, 17)),
        (torch.ops.actcore.hash_uniform.default, (arange.view(10, 10).t(), 3)),
    ]


def check_errors_are_clear(device: str) -> None:
    """The kernels' argument checks name the bad value and what is allowed."""
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"bits must be in 1\.\.8, got 9"):
        torch.ops.actcore.quantize.default(x, 9, 8, False, 0, True)
    with pytest.raises(RuntimeError, match="multiple of 8, got 12"):
        torch.ops.actcore.quantize.default(x, 2, 12, False, 0, True)
    with pytest.raises(RuntimeError, match="takes float32, float16, bfloat16 or float64"):
        torch.ops.actcore.quantize.default(x.int(), 2, 8, False, 0, True)
    payload, lo, step = torch.ops.actcore.quantize.default(x, 2, 8, False, 0, True)
    with pytest.raises(RuntimeError, match="payload has shape"):
        torch.ops.actcore.dequantize.default(
            payload[:, :1], lo, step, 2, 8, [4, 8], torch.float32, True
        )
    with pytest.raises(RuntimeError, match="holds at most"):
        torch.ops.actcore.unpack_bits.default(
            torch.zeros(2, dtype=torch.uint8, device=device), 2, 9
        )
