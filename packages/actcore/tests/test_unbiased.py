"""Compressed gradients are unbiased: the mean of n of them converges to the exact gradient
like 1/sqrt(n), for every kind of tensor a model saves, on both routes, with and without an
outlier channel.

Stochastic rounding adds noise of zero mean; a backward that is linear in each rounded
tensor keeps it zero-mean, so the error of the mean of n independent compressed gradients
has expected square ``s^2 / n`` (``s^2``: the mean square error of one). A bias ``b`` adds
``b^2`` that no n removes. Each case draws n = 64 gradients of the same batch (fresh
rounding every step) and asserts that the error of their mean is at most 1.5x
``s / sqrt(n)``, with ``s`` the root mean square of the 64 single-step errors (so a plan
that changes bits between steps is judged by the noise it really had): for a gradient of
thousands of elements that ratio concentrates near 1 when unbiased, and a bias as small as
15% of one step's noise pushes it past 1.5. Checked for the whole model and for each weight
matrix's gradient.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actcore

N_STEPS = 64
LIMIT = 1.5
OUTLIER = 200.0


def _loss(out: Tensor, weights: Tensor) -> Tensor:
    """A fixed random projection of the output: its gradient is the same full-rank tensor
    every step (a squared loss would make it follow the outlier channel, concentrating the
    noise in a single direction, whose error of the mean no longer concentrates)."""
    return (out * weights).sum() / out.numel()


def _reference(model: nn.Module, x: Tensor) -> tuple[Tensor, nn.Module]:
    """The loss's fixed projection for ``model``'s output, and an uncompressed copy of
    ``model`` holding the exact gradients."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        weights = torch.randn_like(reference(x))
    reference.zero_grad()
    _loss(reference(x), weights).backward()
    return weights, reference


@contextlib.contextmanager
def _compressed(model: nn.Module, route: str, level: str) -> Iterator[nn.Module]:
    """A copy of ``model`` compressing on ``route`` at ``level`` (the hooks installed while
    inside)."""
    compressed = copy.deepcopy(model)
    if route == "convert":
        yield actcore.convert(compressed, level=level)
        return
    controller = actcore.Controller(compressed, level=level)
    controller.install_hook()
    try:
        yield compressed
    finally:
        controller.uninstall_hook()


def _ratios(model: nn.Module, x: Tensor, route: str, level: str) -> dict[str, float]:
    """``error of the mean of N_STEPS gradients / (rms single-step error / sqrt(N_STEPS))``,
    for the whole model (``"all"``) and each weight matrix."""
    weights, reference = _reference(model, x)
    names = [n for n, p in reference.named_parameters() if p.dim() >= 2]
    true = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    keys = ["all", *names]
    total = {k: torch.zeros_like(true[k]) if k != "all" else None for k in keys}
    square = dict.fromkeys(keys, 0.0)
    whole_true = torch.cat([t.flatten() for t in true.values()])
    whole_sum = torch.zeros_like(whole_true)
    with _compressed(model, route, level) as compressed:
        for _ in range(N_STEPS):
            compressed.zero_grad()
            _loss(compressed(x), weights).backward()
            grads = {n: p.grad.detach() for n, p in compressed.named_parameters()}
            whole = torch.cat([grads[n].flatten() for n in true])
            whole_sum += whole
            square["all"] += float((whole - whole_true).norm() / whole_true.norm()) ** 2
            for n in names:
                total[n] += grads[n]
                square[n] += float((grads[n] - true[n]).norm() / true[n].norm()) ** 2
    ratios = {}
    for k in keys:
        mean = whole_sum / N_STEPS if k == "all" else total[k] / N_STEPS
        ref = whole_true if k == "all" else true[k]
        error = float((mean - ref).norm() / ref.norm())
        noise = math.sqrt(square[k] / N_STEPS)
        assert noise > 0, f"{k}: no rounding noise at all (nothing compressed?)"
        ratios[k] = error / (noise / math.sqrt(N_STEPS))
    return ratios


def _assert_unbiased(model: nn.Module, x: Tensor, route: str, level: str) -> None:
    ratios = _ratios(model, x, route, level)
    biased = {k: round(r, 2) for k, r in ratios.items() if r > LIMIT}
    assert not biased, f"mean of {N_STEPS} gradients off by more than {LIMIT}x noise: {biased}"


def _with_outlier(layer: nn.Module, outlier: bool) -> nn.Module:
    if outlier:
        with torch.no_grad():
            layer.weight[0] *= OUTLIER  # one output channel 200x the others
    return layer


# ---- models, one kind of saved tensor each ---------------------------------------------------

WIDTH = 64


def _tokens() -> Tensor:
    return torch.randn(4, 32, WIDTH)


class Between(nn.Module):
    """A linear, ``middle`` (an activation, a normalization module), a linear."""

    def __init__(self, middle: Callable[[Tensor], Tensor], outlier: bool) -> None:
        super().__init__()
        self.first = _with_outlier(nn.Linear(WIDTH, WIDTH), outlier)
        self.middle = middle
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.middle(self.first(x)))


class SwiGLU(nn.Module):
    def __init__(self, outlier: bool) -> None:
        super().__init__()
        self.gate = _with_outlier(nn.Linear(WIDTH, 2 * WIDTH), outlier)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SqueezeExcitation(nn.Module):
    """MobileNet/EfficientNet's block: conv, batch norm, SiLU, a sigmoid gate, conv."""

    def __init__(self, outlier: bool) -> None:
        super().__init__()
        self.conv = _with_outlier(nn.Conv2d(8, 32, 3, padding=1), outlier)
        self.norm = nn.BatchNorm2d(32)
        self.reduce = nn.Conv2d(32, 8, 1)
        self.expand = nn.Conv2d(8, 32, 1)
        self.project = nn.Conv2d(32, 8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.norm(self.conv(x)))
        gate = torch.sigmoid(self.expand(F.silu(self.reduce(F.adaptive_avg_pool2d(h, 1)))))
        return self.project(gate * h)


class Attention(nn.Module):
    def __init__(self, outlier: bool, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = _with_outlier(nn.Linear(WIDTH, 3 * WIDTH), outlier)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Softmax(nn.Module):
    def __init__(self, outlier: bool) -> None:
        super().__init__()
        self.first = _with_outlier(nn.Linear(WIDTH, WIDTH), outlier)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.softmax(self.first(x), dim=-1))


class PythonRMSNorm(nn.Module):
    """An RMS norm written as transformers writes it (recomputed in backward by convert)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class SmallMapBatchNorm(nn.Module):
    """Convolutions with batch norm on a 2x2 map: 16 values per channel at batch 4; a SiLU
    after the norm unless ``silu`` is False."""

    def __init__(self, outlier: bool, silu: bool = True) -> None:
        super().__init__()
        self.conv = _with_outlier(nn.Conv2d(16, 64, 3, padding=1), outlier)
        self.norm = nn.BatchNorm2d(64)
        self.project = nn.Conv2d(64, 16, 1)
        self.silu = silu

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.conv(x))
        return self.project(F.silu(h) if self.silu else h)


ACTIVATIONS: dict[str, Callable[[], Callable[[Tensor], Tensor]]] = {
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "hardswish": nn.Hardswish,
    "functional_gelu_tanh": lambda: lambda t: F.gelu(t, approximate="tanh"),
}

KINDS: dict[str, Callable[[bool], tuple[nn.Module, Tensor]]] = {
    **{
        name: (lambda outlier, make=make: (Between(make(), outlier), _tokens()))
        for name, make in ACTIVATIONS.items()
    },
    "softmax": lambda outlier: (Softmax(outlier), _tokens()),
    "log_softmax": lambda outlier: (Between(nn.LogSoftmax(-1), outlier), _tokens()),
    "swiglu": lambda outlier: (SwiGLU(outlier), _tokens()),
    "squeeze_excitation": lambda outlier: (
        SqueezeExcitation(outlier),
        torch.randn(4, 8, 8, 8),
    ),
    "attention": lambda outlier: (Attention(outlier), _tokens()),
    "layer_norm": lambda outlier: (Between(nn.LayerNorm(WIDTH), outlier), _tokens()),
    "rms_norm": lambda outlier: (Between(nn.RMSNorm(WIDTH), outlier), _tokens()),
    "python_rms_norm": lambda outlier: (Between(PythonRMSNorm(WIDTH), outlier), _tokens()),
    "batch_norm_small_map": lambda outlier: (
        SmallMapBatchNorm(outlier),
        torch.randn(4, 16, 2, 2),
    ),
}

ROUTES = [("convert", "L3"), ("convert", "L2"), ("hooks", "G1"), ("hooks", "G1.2")]


OPEN: dict[tuple[str, bool, str, str], str] = {}
SMOOTH = [*ACTIVATIONS, "swiglu"]
"""Cases still biased, with why: they run and must fail (strict xfail), so a fix shows."""


@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("route,level", ROUTES, ids=[f"{r}-{lv}" for r, lv in ROUTES])
def test_mean_of_compressed_gradients_converges(
    kind: str,
    outlier: bool,
    route: str,
    level: str,
    one_thread: None,
    request: pytest.FixtureRequest,
) -> None:
    reason = OPEN.get((kind, outlier, route, level))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    torch.manual_seed(0)
    model, x = KINDS[kind](outlier)
    _assert_unbiased(model, x, route, level)


@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
@pytest.mark.parametrize("kind", SMOOTH)
@pytest.mark.parametrize("level", ["L3", "L2"])
def test_kept_derivatives_are_unbiased(
    kind: str, outlier: bool, level: str, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``config.keep_derivatives`` a smooth activation keeps ``f'(x)`` stochastically
    rounded and the next layer its own output: backward is linear in both, so unbiased
    even with the outlier channel."""
    monkeypatch.setattr(actcore.config, "keep_derivatives", True)
    torch.manual_seed(0)
    model, x = KINDS[kind](outlier)
    _assert_unbiased(model, x, "convert", level)


def test_hooks_route_gives_a_batch_norm_on_a_small_map_its_bits(
    one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks route raises a batch norm's saved input to ``batch_norm_bits`` (5 here):
    unbiased; at the level's 2 bits the conv before it is visibly biased."""
    torch.manual_seed(0)
    model, x = SmallMapBatchNorm(outlier=False, silu=False), torch.randn(4, 16, 2, 2)
    _assert_unbiased(model, x, "hooks", "G1.2")
    monkeypatch.setattr(actcore.layers.roles, "batch_norm_bits", lambda t: 1)
    assert _ratios(model, x, "hooks", "G1.2")["conv.weight"] > LIMIT


def test_the_check_sees_a_biased_gradient(one_thread: None, small_tensors: None) -> None:
    """The statistic fails a gradient that is biased: tanh's derivative evaluated at a rounded
    input (what the hooks route computes when tanh saves its input, here forced by an
    explicit ``x * (1 - tanh(x)^2)`` backward written as a custom function)."""

    class RoundedTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.tanh(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * (1 - torch.tanh(x).square())

    torch.manual_seed(0)
    model = Between(RoundedTanh.apply, outlier=True)
    ratios = _ratios(model, _tokens(), "hooks", "G1.2")
    assert ratios["first.weight"] > LIMIT


DEFAULTS = [("convert", "L3"), ("convert", "L2"), ("hooks", "G1"), ("hooks", "G2")]


@pytest.mark.parametrize("kind", ["gelu", "silu", "tanh", "sigmoid"])
@pytest.mark.parametrize("route,level", DEFAULTS, ids=[f"{r}-{lv}" for r, lv in DEFAULTS])
def test_linear_after_an_outlier_activation_is_within_five_percent(
    kind: str, route: str, level: str, one_thread: None
) -> None:
    """A linear after a smooth activation whose input has one channel 200x the others: the
    mean of 60 compressed weight gradients of that linear is within 5% of the true one
    (rebuilding its input as ``f(q(x))`` from a group whose step the outlier set was 13%
    off for GELU and 83% for tanh). At the routes' default levels and the convert route's
    L2: at 2 bits for everything (hooks L1.2) one step's noise alone is about 65%, 8.5%
    for the mean of 60 (the test above shows it unbiased there)."""
    torch.manual_seed(0)
    model, x = Between(ACTIVATIONS[kind](), outlier=True), _tokens()
    weights, reference = _reference(model, x)
    true = reference.second.weight.grad
    total = torch.zeros_like(true)
    with _compressed(model, route, level) as compressed:
        for _ in range(60):
            compressed.zero_grad()
            _loss(compressed(x), weights).backward()
            assert not torch.equal(compressed.second.weight.grad, true)  # compressed at all
            total += compressed.second.weight.grad
    error = float((total / 60 - true).norm() / true.norm())
    assert error <= 0.05, f"mean of 60 weight gradients {error:.1%} off the true one"
