"""Per-layer statistics of adaptive bits: what a layer keeps, and how a step's values enter.

:class:`LayerStats` holds one layer's running statistics (device tensors) and its plan (host
ints); :func:`ema` and :func:`finite_ema` take a step's value into an exponential average
on the device (a non-finite value left out and reported, with no host sync), :func:`has_finite`
reads whether one holds a finite value (at replans only); :func:`gradient_coupling` is the factor
``kappa`` of a linear layer's sensitivity. The variance model they feed is in
:mod:`actcore.adaptive`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__: list[str] = []


@dataclass
class LayerStats:
    """Running statistics and plan of one layer (device tensors, host plan)."""

    sens: torch.Tensor | None = None  # scalar: sensitivity s_l
    profile: torch.Tensor | None = None  # [N]: range weights w, sorted, largest first
    elems: torch.Tensor | None = None  # scalar: elements stored per sample
    zero_value: bool = False
    plan: list[int] = field(default_factory=list)  # bits by rank (non-increasing)
    norm: bool = False  # a normalization layer (its input error reaches the input gradient)
    shares: str | None = None  # the layer whose stored input this one reuses (stored once)
    last_step: int | None = None  # the step that last packed an input here (None: unknown)
    readers: set[str] = field(default_factory=set)  # linears reusing this one's stored input
    pinned: bool = False  # packed at the row-norm bits as a shared hidden state (no plan)
    grads: torch.Tensor | None = None  # [samples]: squared output-grad norm (NaN: unseen)
    # finite values taken into sens / profile so far (None: every value was finite)
    sens_seen: torch.Tensor | None = None
    profile_seen: torch.Tensor | None = None


def ema(old: torch.Tensor | None, new: torch.Tensor, momentum: float) -> torch.Tensor:
    new = new.detach().float()
    if old is None or old.shape != new.shape or old.device != new.device:
        return new.clone()
    return old.mul_(momentum).add_(new, alpha=1 - momentum)


def squared_norm(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``|t|^2`` (along ``dim``, else whole) as float32. The norm accumulates in float32 in
    every case; a ``dtype=`` argument would first copy the whole tensor to it, so only
    float16 (whose norm may overflow) takes that copy, and float64 keeps its own precision
    (``vector_norm`` refuses to narrow); a bfloat16 norm is rounded to bfloat16 (2**-9)."""
    if t.dtype == torch.float16:
        return torch.linalg.vector_norm(t, dim=dim, dtype=torch.float32).square()
    return torch.linalg.vector_norm(t, dim=dim).float().square()


def finite_ema(
    old: torch.Tensor | None,
    seen: torch.Tensor | None,
    new: torch.Tensor,
    momentum: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(average, finite values seen, taken)``: ``new`` enters only if all of it is finite.

    Device ops only (no host sync): a non-finite ``new`` leaves the average as it was (zero
    before any finite value), and ``taken`` is a 0-d bool tensor saying whether it entered.
    """
    new = new.detach().float()
    safe = new.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    taken = safe.eq(new).all()  # every value finite (a NaN or an inf was replaced)
    fresh = old is None or old.shape != new.shape or old.device != new.device
    if fresh:
        old = torch.zeros_like(new)
        seen = torch.zeros((), dtype=torch.int64, device=new.device)
    elif seen is None:  # set by hand (tests, old states): holds a finite value already
        seen = torch.ones((), dtype=torch.int64, device=new.device)
    assert old is not None and seen is not None
    # the old average's weight: 1 when this value is left out, else the momentum once a
    # finite value was seen (0 before: the first one enters whole); one fused update, in
    # place (the running statistics keep their storage: no allocation outlives the step)
    weight = torch.where(taken, (seen > 0) * momentum, 1.0)
    old.lerp_(safe, 1.0 - weight)  # (exact at the ends: a skipped value leaves ``old`` as is)
    seen.add_(taken)
    return old, seen, taken


def has_finite(value: torch.Tensor | None, seen: torch.Tensor | None) -> bool:
    """Whether a statistic has a finite value (host read: at replans only)."""
    return value is not None and (seen is None or int(seen) > 0) and math.isfinite(float(value))


def gradient_coupling(grad: torch.Tensor, restored: torch.Tensor, group_size: int) -> torch.Tensor:
    """``kappa``: a linear layer's weight-gradient error over what the mean gradient predicts.

    The error stochastic rounding of input position ``t`` (a token) adds to the weight
    gradient is ``|g_t|^2 e_t``, with ``e_t`` the rounding variance of the position's
    elements, proportional to the squared ranges of their groups. The variance model
    takes ``mean(|g_t|^2) * sum(e_t)``; where large gradients meet large ranges (or
    small ones) that is off by this factor, ``sum(|g_t|^2 e_t) / (mean(|g_t|^2) sum(e_t))``
    (measured on a post-norm OLMo-2: 0.42 to 3.0 across its linears; times this factor, the
    model's error over the measured one is 0.65-0.69 for every one of them, 0.3-2.1
    without). Ranges are read off the restored input's groups (a group's restored values
    span its range at any bits: stochastic rounding lands on both ends of a group of many
    elements).
    """
    n, channels = restored.shape[0], restored.shape[-1]
    one = torch.ones((), device=grad.device)
    if restored.dim() < 2 or grad.shape[:-1] != restored.shape[:-1] or restored.numel() == 0:
        return one
    positions = restored[0].numel() // channels
    flat = restored.detach().reshape(n, -1)
    size = flat.shape[1]
    pad = -size % group_size
    if pad:  # repeat the last element: the last group's range is unchanged
        flat = torch.cat([flat, flat[:, -1:].expand(n, pad)], 1)
    groups = flat.view(n, -1, group_size)
    ranges = (groups.amax(-1) - groups.amin(-1)).float().square()  # [N, groups]
    if channels % group_size == 0:  # whole groups per position
        spread = ranges.view(n, positions, -1).sum(-1) * group_size
    elif group_size % channels == 0:  # whole positions per group
        spread = _repeat(ranges, group_size // channels)[:, :positions] * channels
    else:
        per_element = _repeat(ranges, group_size)[:, :size]
        spread = per_element.view(n, positions, channels).sum(-1)
    energy = squared_norm(grad.detach().reshape(n, positions, -1), dim=-1)
    expected = energy.mean() * spread.sum()
    return torch.where(expected > 0, (energy * spread).sum() / expected, one)


def _repeat(x: torch.Tensor, times: int) -> torch.Tensor:
    """``x.repeat_interleave(times, 1)`` of a 2-D ``x`` as a view and one copy (no device
    synchronisation: ``repeat_interleave`` sizes its output from the data on CUDA)."""
    return x.unsqueeze(-1).expand(*x.shape, times).reshape(x.shape[0], -1)
