"""Compression primitives: per-group k-bit quantization, bit packing, 1-bit masks.

Every op is a ``torch.library`` operator (``torch.ops.actcore.*``) with a fake kernel and
a pure-PyTorch reference implementation that runs on any device.
"""

from __future__ import annotations

from .api import (
    FLOAT_DTYPES,
    apply_mask,
    dequantize,
    hash_uniform,
    masked_dequantize,
    masked_quantize,
    new_seed,
    pack_bits,
    pack_mask,
    quantize,
    reset_seed_stream,
    unpack_bits,
    unpack_mask,
)
from .packed import Packed

__all__ = [
    "FLOAT_DTYPES",
    "Packed",
    "apply_mask",
    "dequantize",
    "hash_uniform",
    "masked_dequantize",
    "masked_quantize",
    "new_seed",
    "pack_bits",
    "pack_mask",
    "quantize",
    "reset_seed_stream",
    "unpack_bits",
    "unpack_mask",
]
