"""A Q-layer inside its model's scope holds its packed tensors on its autograd node, past
the scope's saved-tensor hooks (which would only pass them through), and frees them when
its backward runs, as autograd frees saved tensors; a user's hooks still see them all."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import actcore


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 1)
    )


def _conv_node(out: torch.Tensor) -> object:
    """The last convolution's autograd node (its ctx)."""
    return out.grad_fn


def test_packings_are_held_on_the_node_and_freed_by_its_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 1))
    model = actcore.convert(model, "L3")
    x = torch.randn(4, 8, 16, 16)
    out = model(x)
    node = _conv_node(out)
    held = [t for t in node.act_held if t is not None]
    assert held and all(t.dtype == torch.uint8 or t.numel() < x.numel() for t in held)
    refs = [weakref.ref(t) for t in held]
    del held
    out.sum().backward()
    gc.collect()
    assert all(r() is None for r in refs)  # freed, while the graph (out) is still alive
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


def test_retain_graph_keeps_them_for_a_second_backward() -> None:
    model = actcore.convert(_model(), "L3")
    x = torch.randn(4, 8, 16, 16)
    torch.manual_seed(1)
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    for a, p in zip(first, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a)  # (the same packings restored again)


def test_the_gradients_are_those_of_packings_passed_through_the_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Holding the packings on the node changes where they live, not what backward reads."""
    from actcore.layers import stash

    base, x = _model(), torch.randn(4, 8, 16, 16)
    grads = []
    for holds in (True, False):
        if not holds:
            monkeypatch.setattr(stash, "_holds_packings", lambda: False)
        model = actcore.convert(copy.deepcopy(base), "L3", seed=3)
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_a_users_hooks_still_see_every_packed_tensor() -> None:
    """Inside ``save_on_cpu`` (or any hooks of the user's around the model) the packings go
    through the saved-tensor hooks, which hand them on to the user's."""
    model = actcore.convert(_model(), "L3")
    x = torch.randn(4, 8, 16, 16)
    seen: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    assert _conv_node(out).act_held is None
    assert torch.uint8 in seen  # (the codes of a packing)
    out.sum().backward()


def test_the_tracker_counts_the_held_packings(monkeypatch: pytest.MonkeyPatch) -> None:
    """actcore.memory.track counts what the nodes hold as it counted what the hooks kept."""
    from actcore.layers import stash

    base, x = _model(), torch.randn(4, 8, 16, 16)
    kept = []
    for holds in (True, False):
        if not holds:
            monkeypatch.setattr(stash, "_holds_packings", lambda: False)
        model = actcore.convert(copy.deepcopy(base), "L3")
        with actcore.memory.track(model) as report:
            out = model(x)
        kept.append(report.retained_bytes)
        out.sum().backward()
    assert kept[0] == kept[1] > 0, kept


def test_a_derived_input_holds_the_packings_it_is_rebuilt_from() -> None:
    """A linear reading a layer norm's output keeps it as derived from the norm's packing:
    the tensors that packing made are held on the linear's node too; the norm's weight and
    bias, which the rebuild reads, stay saved tensors (autograd checks their versions)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    model = actcore.convert(model, "L3")
    out = model(torch.randn(4, 32, 64))
    node = out.grad_fn
    while type(node).__name__ != "LinearFunctionBackward":
        node = node.next_functions[0][0]
    held = [t for t in node.act_held if t is not None]
    assert any(t.dtype == torch.uint8 for t in held)  # (the norm's codes)
    params = {id(p) for p in model.parameters()}
    assert not any(id(t) in params for t in held)
    norm = model[1]
    saved = {t.data_ptr() for t in node.saved_tensors}
    assert {norm.weight.data_ptr(), norm.bias.data_ptr()} <= saved
    out.sum().backward()
