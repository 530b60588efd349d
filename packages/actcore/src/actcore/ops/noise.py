"""Counter-based uniform noise for stochastic rounding.

The noise of element ``i`` under seed ``s`` is a pure function of ``(s, i)``, so every
backend (this pure-PyTorch reference, a CUDA kernel, a CPU kernel) reproduces it bit for
bit, whatever the launch geometry or memory layout.

Definition (all arithmetic on unsigned 32-bit words)::

    mix(x)   = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15
    key(hi)  = mix(mix(hi ^ seed_hi) ^ seed_lo)        # hi = i >> 32, seed_lo/hi = 32-bit halves
    h(s, i)  = mix((i & 0xFFFFFFFF) ^ key(i >> 32))
    u(s, i)  = (h >> 8) * 2**-24                       # exact in float32, in [0, 1)

Both multipliers are below 2**31, so the products of 32-bit words fit in a signed 64-bit
integer: the reference computes in int64 without overflow on any device. Indices are
64-bit (tensors over 2**31 elements); within a block of 2**32 consecutive indices the key
is a constant, which is what makes the reference cheap (one ``mix`` per element).
"""

from __future__ import annotations

import torch

__all__ = [
    "MASK32",
    "MULT_A",
    "MULT_B",
    "SEED_LIMIT",
    "block_key",
    "hash_index",
    "mix32",
    "uniform_from_hash",
    "uniform_noise",
]

MASK32 = 0xFFFFFFFF
MULT_A = 0x21F0AAAD
MULT_B = 0x735A2D97
SEED_LIMIT = 1 << 63  # seeds travel as signed int64 in op schemas


def mix32(x):
    """The 32-bit finaliser, on Python ints or int64 tensors holding values in [0, 2**32).

    A tensor argument is updated in place (and returned): this runs per element.
    """
    if isinstance(x, torch.Tensor):
        x.bitwise_xor_(x >> 16).mul_(MULT_A).bitwise_and_(MASK32)
        x.bitwise_xor_(x >> 15).mul_(MULT_B).bitwise_and_(MASK32)
        return x.bitwise_xor_(x >> 15)
    x = x ^ (x >> 16)
    x = (x * MULT_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MULT_B) & MASK32
    return x ^ (x >> 15)


def block_key(seed: int, hi):
    """Key of the block of 2**32 indices whose upper word is ``hi`` (int or int64 tensor)."""
    return mix32(mix32(hi ^ (seed >> 32)) ^ (seed & MASK32))


def hash_index(
    index: torch.Tensor, seed: int, index_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """32-bit hash (as int64 in [0, 2**32)) of each int64 element index under ``seed``.

    ``index_range`` (smallest, largest index), when the caller knows it, saves a device sync.
    """
    lo = index & MASK32
    first, last = index_range if index_range is not None else (int(index.min()), int(index.max()))
    if (first >> 32) == (last >> 32):
        key = block_key(seed, first >> 32)  # one block: the key is a host constant
    else:
        key = block_key(seed, index >> 32)
    return mix32(lo.bitwise_xor_(key))


def uniform_from_hash(h: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map 32-bit hashes to uniforms in [0, 1) on a 2**-24 grid (exact in fp32 and fp64)."""
    return (h >> 8).to(dtype).mul_(2.0**-24)


def uniform_noise(index: torch.Tensor, seed: int, dtype: torch.dtype = torch.float32):
    """Uniform noise in [0, 1) for int64 element indices; empty input gives empty output."""
    if index.numel() == 0:
        return torch.empty(index.shape, dtype=dtype, device=index.device)
    return uniform_from_hash(hash_index(index, seed), dtype)
