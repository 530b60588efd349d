"""Probe item 9: saved-tensor hooks of a user's (``save_on_cpu``, a profiler's) around a
converted model or a ``compress_saved_tensors`` block are handed what actcore keeps."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import actcore


class _Boxing:
    """A user's saved-tensor hooks: record what they are handed (but ``model``'s parameters),
    keep it in a box (so what backward reads can only come back through their unpack)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.packed: list[tuple[torch.dtype, int]] = []
        self.unpacked = 0
        params = () if model is None else model.parameters()
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        if t.untyped_storage().data_ptr() not in self.params:
            self.packed.append((t.dtype, t.numel() * t.element_size()))
        return ("box", t.clone())

    def unpack(self, box: tuple[str, torch.Tensor]) -> torch.Tensor:
        self.unpacked += 1
        return box[1]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
    )


def test_hooks_around_a_converted_model_receive_its_packings() -> None:
    """Item 9: a user's saved-tensor hooks around a converted model's forward are handed
    what actcore keeps (its packings: few bytes, uint8) and give it back for backward: the
    gradients are bitwise those of the same model without the user's hooks; no warning."""
    x = torch.randn(32, 64)
    plain = _net()
    plain_user = _Boxing(plain)
    with plain_user.hooks():
        plain(x).sum().backward()
    plain_bytes = sum(n for _, n in plain_user.packed)
    ref = actcore.convert(_net(), "L3", seed=7)
    ref(x).sum().backward()
    model = actcore.convert(_net(), "L3", seed=7)
    user = _Boxing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with user.hooks():
            model(x).sum().backward()
    assert user.unpacked > 0 and torch.uint8 in {dtype for dtype, _ in user.packed}
    act_bytes = sum(n for _, n in user.packed)
    assert plain_bytes >= 4 * act_bytes, (plain_bytes, act_bytes)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_save_on_cpu_around_a_converted_model_and_the_hooks_route() -> None:
    """Item 9: ``save_on_cpu`` composes too (it offloads actcore's packings), on the layer
    route and around ``compress_saved_tensors``: the same gradients as without it."""
    x = torch.randn(32, 64)
    ref = actcore.convert(_net(), "L2", seed=3)
    ref(x).sum().backward()
    model = actcore.convert(_net(), "L2", seed=3)
    with torch.autograd.graph.save_on_cpu():
        model(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)

    grads = []
    for enclosed in (False, True):
        net = _net()
        actcore.ops.reset_seed_stream()
        user = _Boxing()
        with user.hooks() if enclosed else contextlib.nullcontext():
            with actcore.compress_saved_tensors("G2", model=net):
                loss = net(x).sum()
            loss.backward()
        grads.append([p.grad for p in net.parameters()])
        if enclosed:
            assert torch.uint8 in {dtype for dtype, _ in user.packed} and user.unpacked > 0
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_in_place_change_under_enclosing_hooks_still_raises() -> None:
    """Item 9 with item 10's rule: a saved tensor changed in place after the forward raises
    autograd's error at backward, also when a user's hooks hold actcore's packings."""
    model = actcore.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), "L3")
    x = torch.randn(32, 64)
    with _Boxing().hooks():
        hidden = model[0](x)
        out = model[1](hidden)
    with torch.no_grad():
        hidden.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    a = torch.randn(64, 64, requires_grad=True)
    with _Boxing().hooks(), actcore.compress_saved_tensors("G2"):
        h = a * 2
        out = h * h  # saves h: packed, handed to the user's hooks
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("copies", [False, True])
def test_in_place_change_of_a_kept_tensor_under_user_hooks_raises(copies: bool) -> None:
    """A tensor actcore keeps as it is (below ``min_numel``), handed to user hooks that keep
    the very object (a profiler's) or a copy (``save_on_cpu``), then changed in place:
    autograd's error at backward either way (one rule), never a silent gradient."""
    a = torch.randn(8, 8, requires_grad=True)
    keep = (lambda t: t.clone()) if copies else (lambda t: t)
    user = torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t)
    with user, actcore.compress_saved_tensors("G2"):
        h = a * 2
        out = h * h  # h: 64 elements, kept as it is
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_checkpoint_and_actcore_hooks_around_a_converted_model_do_not_warn() -> None:
    """Checkpoint's hooks and actcore's own tracker around a converted model are expected:
    no warning, and checkpointing still recomputes (the same gradients as without it)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(32, 64)
    model = actcore.convert(_net(), "L0")
    ref = [g.clone() for g in torch.autograd.grad(model(x).sum(), list(model.parameters()))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = checkpoint(model, x, use_reentrant=False).sum()
        got = torch.autograd.grad(out, list(model.parameters()))
        with actcore.memory.track(model):
            model(x).sum().backward()
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
