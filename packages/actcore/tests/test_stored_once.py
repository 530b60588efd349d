"""A tensor two ops keep is stored once: a normalization's output is rebuilt from the
normalized input the norm keeps, and a language model's head shares its input with the
loss that recomputes the logits."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore import memory, stash
from actcore.compressors import Derived


class NormThenLinear(nn.Module):
    """``norm -> two linears`` (q/k/v or gate/up projections of one normalized state)."""

    def __init__(self, norm: nn.Module, d: int = 128) -> None:
        super().__init__()
        self.norm, self.a, self.b = norm, nn.Linear(d, d), nn.Linear(d, d)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        self.seen = [h]
        return self.a(h) * torch.sigmoid(self.b(h))


class GroupNormThenConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(4, 16), nn.Conv2d(16, 16, 3, padding=1)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        self.seen = [h]
        return self.conv(h)


def _case(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "groupnorm":
        return GroupNormThenConv(), torch.randn(8, 16, 16, 16)
    norm = nn.LayerNorm(128) if kind == "layernorm" else nn.RMSNorm(128)
    with torch.no_grad():  # a non-trivial affine: the rebuild must apply it
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    return NormThenLinear(norm), torch.randn(16, 32, 128) * 3 + 1


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "groupnorm"])
def test_norm_output_is_rebuilt_from_its_normalized_input(kind: str, monkeypatch) -> None:
    plain, x = _case(kind)
    model = actcore.convert(copy.deepcopy(plain), "L3")
    with memory.track(model) as rep:
        out = model(x)
    (h,) = model.seen
    part = stash.packing_of(h)
    assert part is not None and isinstance(part[0], Derived)
    rebuilt = part[0].unpack(part[1], part[2])
    # the rebuild is the norm's output up to the 4-bit rounding of the normalized input
    # (at most one step of the per-group range: a unit-variance row spans ~8, so < 0.6)
    assert rebuilt.shape == h.shape and rebuilt.dtype == h.dtype
    err = (rebuilt - h).abs().max().item()
    assert 0 < err < 0.6 * plain.norm.weight.detach().abs().max().item()
    out.square().mean().backward()
    derived_bytes = rep.retained_bytes

    # without the rebuild the linears keep a packing of their own
    import actcore.layers.norm_functions as norm_functions

    monkeypatch.setattr(norm_functions, "derive_output", lambda *a, **k: None)
    again = actcore.convert(copy.deepcopy(plain), "L3")
    with memory.track(again) as rep:
        out = again(x)  # (held: the graph lives as long as its output)
    own = actcore.ops.quantize(h.detach(), 2).nbytes  # L3's first plan: 2 bits
    assert rep.retained_bytes - derived_bytes >= own


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "groupnorm"])
def test_gradients_through_a_rebuilt_norm_output(kind: str) -> None:
    plain, x = _case(kind)
    model = actcore.convert(copy.deepcopy(plain), "L2")
    torch.manual_seed(1)
    out = plain(x)
    out.square().mean().backward()
    torch.manual_seed(1)
    conv_out = model(x)
    assert torch.equal(conv_out, out)
    conv_out.square().mean().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        cos = F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.98, cos


class TinyLM(nn.Module):
    """Embedding, a block, final norm, head, and the loss computed in forward."""

    def __init__(self, vocab: int = 96, d: int = 64, shift: str = "pad") -> None:
        super().__init__()
        self.shift = shift
        self.emb = nn.Embedding(vocab, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(self.norm(h))
        vocab = logits.shape[-1]
        if self.shift == "pad":  # shifted as transformers 5 does
            targets = F.pad(ids[:, 1:], (0, 1), value=-100)
            return F.cross_entropy(logits.view(-1, vocab), targets.flatten())
        if self.shift == "slice":  # as transformers 4 and many training scripts do
            shifted = logits[..., :-1, :].contiguous()
            return F.cross_entropy(shifted.view(-1, vocab), ids[:, 1:].reshape(-1))
        picked = logits[:, torch.tensor([3, 7, 11])]  # rows picked by an index tensor
        return F.cross_entropy(picked.reshape(-1, vocab), ids[:, :3].reshape(-1))


@pytest.mark.parametrize("shift", ["pad", "slice", "index"])
def test_loss_head_keeps_the_input_the_loss_keeps(shift: str) -> None:
    """After the first step the head's weight gradient is exact (its input is the tensor the
    loss keeps anyway to recompute the logits) and the head stores nothing of its own; the
    logits' rows may be selected (shifted, picked) before the loss."""
    torch.manual_seed(0)
    plain = TinyLM(shift=shift)
    model = actcore.convert(copy.deepcopy(plain), "L3")
    ids = torch.randint(0, 96, (8, 48))
    model(ids).backward()  # the loss marks the head
    assert model.head.act_feeds_loss is True
    model.zero_grad()
    plain(ids).backward()
    with memory.track(model) as rep:
        loss = model(ids)
    loss.backward()
    torch.testing.assert_close(model.head.weight.grad, plain.head.weight.grad)
    if shift == "index":
        return  # (few rows: the byte comparison below is for the whole sequence)
    # the head's input (8 x 48 x 64 fp32) is held once, exact, by the loss
    hidden_fp32 = 8 * 48 * 64 * 4
    layers_only = actcore.convert(copy.deepcopy(plain), "L3", layers_only=True)
    layers_only(ids).backward()
    with memory.track(layers_only) as plain_rep:
        held = layers_only(ids)  # noqa: F841 (the graph lives as long as its output)
    # layers only: log-probabilities (tokens x vocab, fp32) kept instead of the hidden state
    assert plain_rep.retained_bytes - rep.retained_bytes >= 8 * 47 * 96 * 4 - hidden_fp32


@pytest.mark.parametrize(("classes", "held"), [(10, False), (512, True)])
def test_a_narrow_head_does_not_hold_its_input_for_the_loss(classes: int, held: bool) -> None:
    """A classifier's head over few classes leaves its full-precision input free once the
    forward returns, though the caller keeps the output (keeping it for a loss to recompute
    the logits would cost more than the logits); a head at least as wide as its input (a
    language model's) holds it as long as its output, as the loss recomputes from it."""
    torch.manual_seed(0)
    model = actcore.convert(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, classes)), "L3"
    )
    seen: list[weakref.ref] = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    out = model(torch.randn(32, 64))
    gc.collect()
    assert (seen[0]() is not None) is held
    F.cross_entropy(out, torch.randint(0, classes, (32,))).backward()  # trains either way
    assert model[2].weight.grad is not None and model[2].weight.grad.isfinite().all()


class _Classifier(nn.Module):
    """A classifier computing its loss in its forward, the logits' gradient recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
        self.head = nn.Linear(256, 10)
        self.logits_grad: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        logits.register_hook(lambda g: setattr(self, "logits_grad", g))
        return F.cross_entropy(logits, y)


def test_a_narrow_heads_loss_keeps_its_logits_exact() -> None:
    """The loss of a narrow head keeps the logits themselves (fewer bytes than the head's
    input): the gradient reaching the logits is exactly plain PyTorch's."""
    torch.manual_seed(0)
    plain = _Classifier()
    model = actcore.convert(copy.deepcopy(plain), "L3")
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(2):  # (a second step: nothing marks the head)
        model(x, y).backward()
    plain(x, y).backward()
    assert model.logits_grad is not None and plain.logits_grad is not None
    assert torch.equal(model.logits_grad, plain.logits_grad)
    assert not getattr(model.head, "act_feeds_loss", False)
