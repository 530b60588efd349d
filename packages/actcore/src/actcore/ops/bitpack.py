"""Reference packing of k-bit unsigned integers (k in 1..8) into bytes.

Layout: values are taken in row-major order, zero-padded to a multiple of 8, and every
block of 8 consecutive values becomes ``k`` bytes; byte ``j`` of a block holds bit ``j`` of
its 8 values, value ``t`` of the block in bit ``t`` (least significant first). So ``n``
values take exactly ``ceil(n / 8) * k`` bytes, for every k, and a 1-bit pack is the usual
little-endian bitmask. A kernel that handles 8 values per thread writes ``k`` adjacent bytes.

The reference reads each block of 8 bytes as one int64 and moves bits with shifts and
masks (no reductions over tiny dimensions), which keeps it fast on CPU.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["pack_bits_reference", "packed_nbytes", "unpack_bits_reference"]

_LOW_BITS = 0x0101010101010101  # bit 0 of every byte
# (shift, mask) steps gathering bit 0 of 8 bytes into the low byte; unpacking runs them back.
_GATHER = ((7, 0x0303030303030303), (14, 0x0000000F0000000F), (28, 0xFF))
_SCATTER = ((28, 0x0000000F0000000F), (14, 0x0003000300030003), (7, _LOW_BITS))


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` values of ``bits`` bits take in this layout."""
    return (numel + 7) // 8 * bits


def _as_words(bytes8: torch.Tensor) -> torch.Tensor:
    """View a flat uint8 tensor of 8*n bytes as n little-endian int64 words."""
    words = bytes8.view(torch.int64)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("actcore's reference bit packing assumes a little-endian host")
    return words


def pack_bits_reference(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``values`` (each < 2**bits) into a flat uint8 tensor."""
    flat = values.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    elif not flat.is_contiguous() or flat.data_ptr() % 8:  # int64 view needs alignment
        flat = flat.clone()
    words = _as_words(flat)
    out = torch.empty((words.numel(), bits), dtype=torch.uint8, device=values.device)
    for j in range(bits):
        x = (words >> j).bitwise_and_(_LOW_BITS)
        for shift, mask in _GATHER:
            x.bitwise_or_(x >> shift).bitwise_and_(mask)
        out[:, j] = x
    return out.view(-1)


def unpack_bits_reference(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits_reference`: the first ``numel`` values as uint8."""
    planes = packed.reshape(-1, bits)
    words = torch.zeros(planes.shape[0], dtype=torch.int64, device=packed.device)
    for j in range(bits):
        x = planes[:, j].to(torch.int64)
        for shift, mask in _SCATTER:
            x.bitwise_or_(x << shift).bitwise_and_(mask)
        words.bitwise_or_(x.bitwise_left_shift_(j))
    values = words.view(torch.uint8)
    return values if values.numel() == numel else values[:numel].clone()
