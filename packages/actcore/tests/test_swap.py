"""Swap to pinned CPU memory with prefetch in backward (L4, L5, ``swap``, hooks' L3)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import forward_backward
from torch import nn

import actcore
from actcore import compressors, ops
from actcore.compressors import IDENTITY, PrefetchQueue, Quantize, Swap

CUDA = torch.cuda.is_available()


class _Entry:
    def __init__(self, name: str) -> None:
        self.name = name
        self.fetched = None


def test_queue_returns_entries_packed_just_before_nearest_first() -> None:
    q = PrefetchQueue()
    entries = [_Entry(f"e{i}") for i in range(6)]
    seqs = [q.add(e) for e in entries]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6
    names = lambda got: [e.name for e in got]  # noqa: E731
    assert names(q.upcoming(seqs[5], 2)) == ["e4", "e3"]
    assert names(q.upcoming(seqs[1], 3)) == ["e0"]  # nothing before the first
    assert q.upcoming(seqs[0], 2) == [] and q.upcoming(seqs[5], 0) == []
    entries[4].fetched = ("already", None)  # already on its way: skipped
    assert names(q.upcoming(seqs[5], 2)) == ["e3", "e2"]
    del entries[3]  # freed (its graph is gone): dropped, never kept alive
    gc.collect()
    assert len(q) == 5
    assert names(q.upcoming(seqs[5], 2)) == ["e2", "e1"]


def test_queue_holds_entries_weakly() -> None:
    q = PrefetchQueue()
    for i in range(3):
        q.add(_Entry(str(i)))
    gc.collect()
    assert len(q) == 0


@pytest.mark.parametrize("inner", [IDENTITY, Quantize(4)])
def test_cpu_swap_is_its_inner_compressor(inner) -> None:
    x = torch.randn(4, 1024)
    before = dict(compressors.swap._QUEUES)
    tensors, meta = Swap(inner).pack(x)
    assert meta[0] is None and len(meta) == 2  # nothing swapped, nothing queued
    assert before == compressors.swap._QUEUES
    if inner is IDENTITY:
        assert tensors[0] is x
        assert Swap(inner).unpack(tensors, meta) is x
    else:
        assert torch.equal(Swap(inner).unpack(tensors, meta), inner.unpack(tensors, meta[1]))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )


def test_swap_level_on_cpu_gradients_bitwise_l0() -> None:
    ref = actcore.convert(_mlp(), level="L0")
    swapped = actcore.convert(_mlp(), level="swap")
    x = torch.randn(32, 64)
    for a, b in zip(forward_backward(ref, x)[1], forward_backward(swapped, x)[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_prefetch_on_side_stream_values_exact() -> None:
    dev = torch.device("cuda")
    comp = Swap(IDENTITY, prefetch=2)
    xs = [torch.randn(1024, 256, device=dev) for _ in range(5)]
    packed = [comp.pack(x) for x in xs]
    for tensors, _ in packed:
        assert tensors[0].device.type == "cpu" and tensors[0].is_pinned()
    entries = [meta[2] for _, meta in packed]
    assert all(e.fetched is None for e in entries)
    # backward order: last packed first; unpacking it prefetches the two before it
    out4 = comp.unpack(*packed[4])
    assert torch.equal(out4, xs[4])
    assert entries[3].fetched is not None and entries[2].fetched is not None
    assert entries[1].fetched is None
    side = compressors.swap._SIDE_STREAMS[xs[0].device]  # (keyed by the indexed device)
    assert side != torch.cuda.current_stream(dev)  # the copies ran on a side stream
    for i in (3, 2, 1, 0):
        prefetched = entries[i].fetched
        out = comp.unpack(*packed[i])
        assert torch.equal(out, xs[i])
        if prefetched is not None:  # the consumer got the side stream's copy itself
            assert out.data_ptr() == prefetched[0][0].data_ptr()
        assert entries[i].fetched is None  # consumed: no device copy kept
    torch.cuda.synchronize()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("level, base", [("swap", "L0"), ("L4", "L3")])
def test_cuda_swap_levels_match_their_base(level: str, base: str) -> None:
    x = torch.randn(64, 64, device="cuda")
    ref = actcore.convert(_mlp().cuda(), level=base)
    model = actcore.convert(copy.deepcopy(ref), level=level)
    torch.manual_seed(3)
    ops.reset_seed_stream()
    g_ref = forward_backward(ref, x)[1]
    torch.manual_seed(3)
    ops.reset_seed_stream()
    g = forward_backward(model, x)[1]
    for a, b in zip(g_ref, g, strict=True):
        if base == "L0":
            assert torch.equal(a, b)
        else:  # same seeds, same rounding: swapping moves bytes, never changes them
            assert torch.equal(a, b), (a - b).abs().max()
