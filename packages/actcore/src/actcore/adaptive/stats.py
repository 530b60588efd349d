"""Per-layer statistics of adaptive bits: what a layer keeps, and how a step's values enter.

:class:`LayerStats` holds one layer's running statistics (device tensors) and its plan (host
ints); :func:`finite_emas` takes a step's values into their exponential averages on the
device (a non-finite value left out and reported, with no host sync), all layers' at once
(a few ops per step, not a dozen per layer), :func:`host_emas` the same for host values;
:func:`has_finite` reads whether one holds a finite value (at replans only);
:func:`gradient_coupling` is the factor ``kappa`` of a linear layer's sensitivity. The variance model they feed is in
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


def squared_norm(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``|t|^2`` (along ``dim``, else whole) as float32. The norm accumulates in float32 in
    every case; a ``dtype=`` argument would first copy the whole tensor to it, so only
    float16 (whose norm may overflow) takes that copy, and float64 keeps its own precision
    (``vector_norm`` refuses to narrow); a bfloat16 norm is rounded to bfloat16 (2**-9)."""
    if t.dtype == torch.float16:
        return torch.linalg.vector_norm(t, dim=dim, dtype=torch.float32).square()
    return torch.linalg.vector_norm(t, dim=dim).float().square()


def _fresh(old: torch.Tensor | None, new: torch.Tensor) -> bool:
    return old is None or old.shape != new.shape or old.device != new.device


def _by_shape(news: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``news`` grouped by shape and device (each group stacks into one tensor)."""
    groups: dict[tuple, list[int]] = {}
    for i, new in enumerate(news):
        groups.setdefault((tuple(new.shape), new.device), []).append(i)
    return groups


def finite_emas(
    entries: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]],
    momentum: float,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Each ``(old, seen, new)`` of ``entries`` averaged: ``new`` enters ``old`` (an average,
    None before the first) with ``momentum`` only if all of it is finite; ``seen`` counts the
    finite values taken (None: set by hand, holding one). Device ops only, one stack and one
    update per shape and device.

    Returns each entry's ``(average, seen)``: ``old`` and ``seen`` themselves, updated in
    place (the running statistics keep their storage: no allocation outlives the step),
    new tensors for a first value; and each group's ``taken`` (1-D bool: whether each
    entry's value entered)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(entries)  # type: ignore[list-item]
    taken_by_group = []
    for (shape, device), index in _by_shape([new for _, _, new in entries]).items():
        news = torch.stack([entries[i][2] for i in index]).detach().float()
        olds: list[torch.Tensor | None] = []
        seens: list[torch.Tensor | None] = []
        for i in index:
            old, seen, new = entries[i]
            fresh = _fresh(old, new)
            olds.append(None if fresh else old)
            seens.append(None if fresh or seen is None else seen)
        zero = news.new_zeros(shape) if any(old is None for old in olds) else None
        average = torch.stack([zero if old is None else old for old in olds])
        # a first value: nothing seen; set by hand (tests, old states): holds a finite one
        counts = [
            seen
            if seen is not None
            else torch.full((), 0 if old is None else 1, dtype=torch.int64, device=device)
            for old, seen in zip(olds, seens, strict=True)
        ]
        seen_all = torch.stack(counts)
        safe = news.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        same = safe.eq(news)
        taken = same.flatten(1).all(1) if same.dim() > 1 else same  # per entry: all finite
        # the old average's weight: 1 when a value is left out, else the momentum once a
        # finite value was seen (0 before: the first one enters whole; lerp is exact at the
        # ends, so a skipped value leaves the average as it was)
        weight = torch.where(taken, (seen_all > 0) * momentum, 1.0)
        average.lerp_(safe, (1.0 - weight).view(-1, *([1] * len(shape))))
        seen_all.add_(taken)
        averages, seen_now = average.unbind(0), seen_all.unbind(0)
        back = [j for j, old in enumerate(olds) if old is not None]  # written back in place
        if back:
            torch._foreach_copy_([olds[j] for j in back], [averages[j] for j in back])  # type: ignore[misc]
        counted = [j for j, seen in enumerate(seens) if seen is not None]
        if counted:
            torch._foreach_copy_([seens[j] for j in counted], [seen_now[j] for j in counted])  # type: ignore[misc]
        for j, i in enumerate(index):
            old, seen = olds[j], seens[j]
            out[i] = (
                averages[j].clone() if old is None else old,
                seen_now[j].clone() if seen is None else seen,
            )
        taken_by_group.append(taken)
    return out, taken_by_group


def host_emas(
    olds: list[torch.Tensor | None], values: list[float], momentum: float
) -> list[torch.Tensor]:
    """Each ``old`` (None before the first) averaged with its host value with ``momentum``,
    as float32 on the CPU, in one update; ``old`` itself updated in place (a new tensor for
    a first value)."""
    if not olds:
        return []
    news = torch.tensor(values, dtype=torch.float32)
    fresh = [_fresh(old, news[0]) for old in olds]
    kept = [i for i, first in enumerate(fresh) if not first]
    if kept:
        average = torch.stack([olds[i] for i in kept])  # type: ignore[misc]
        rows = news if len(kept) == len(olds) else news[kept]
        average.mul_(momentum).add_(rows, alpha=1 - momentum)
        torch._foreach_copy_([olds[i] for i in kept], list(average.unbind(0)))  # type: ignore[misc]
    return [
        news[i].clone() if first else old  # type: ignore[misc]
        for i, (old, first) in enumerate(zip(olds, fresh, strict=True))
    ]


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
