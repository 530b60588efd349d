"""``ChannelScaled``: outlier channels kept apart before another compressor packs.

Quantization groups run along memory, so in a ``[tokens, features]`` tensor every group
holds every feature. One outlier feature (common in language models' hidden states, or
after a weight row that grew) then sets the rounding step of all its group's other
elements: 200x larger values there make the step 200x coarser for the 255 others. And a
backward that is nonlinear in the saved tensor (a norm's ``x_hat * mean(g * x_hat)``,
attention's softmax of ``q k^T``) turns the outlier's own rounding variance into a bias.

``ChannelScaled(inner, dim, exact)`` keeps the ``exact`` channels of largest magnitude along
``dim`` as they are, divides each other channel whose largest magnitude is above ``ratio``
times the median channel's by its excess, packs that with ``inner``, and undoes both on
unpacking. Channels within ``ratio`` of the median are divided and multiplied by exactly 1.
The scales are powers of two, kept as one int8 exponent per channel, so dividing and
multiplying by them is exact in every float dtype and stochastic rounding stays unbiased:
``E[s * q(x / s)] = x``. No host synchronisation: scales and the top channels are computed
on the device, with a fixed count, never read.

Any power-of-two scale keeps the rounding unbiased, so a layer may reuse the exponents it
computed on an earlier step (:class:`ChannelScales`): only the variance depends on how
well they fit the step's values, and finding them costs two reductions over the tensor and
a dozen small ops, which a steady step then skips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Compressor, Tensors, Wrapping

__all__ = [
    "OUTLIER_RATIO",
    "ChannelScaled",
    "ChannelScales",
    "channel_dim",
    "channel_exponents",
    "exact_channels",
    "joint_top",
    "joint_top_and_amax",
    "scaled",
]

OUTLIER_RATIO = 4.0
"""A channel is an outlier when its largest magnitude exceeds this many times the median
channel's; it is then scaled down to that bound."""

_MAX_SCALE = 2.0**20  # a channel is never divided by more (nor by a non-finite scale)


def _channel_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each channel's largest magnitude (float32, NaN where the channel has one), from two
    reductions: ``abs()`` first would make a temporary of ``x``'s size."""
    x = x.detach()
    if _dense(x):
        others = [d for d in range(x.dim()) if d != dim]
        high = x.amax(dim=others, keepdim=True).float()
        low = x.amin(dim=others, keepdim=True).float()
    else:
        high, low = _strided_extremes(x, dim)
    return torch.maximum(high, low.neg_())


def _strided_extremes(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's max and min (float32, shaped to broadcast against ``x``) of a tensor
    that is not dense, such as the heads of q sliced from a fused qkv projection.

    ATen's CPU reduction over such a view is 10-30x slower than over rows (0.5 ms for a
    char GPT's q, 7.5 ms for a Llama's at sequence 2048): the channel dim goes last, the
    other dims in memory order, and the dims next to it in memory join it in one row, so the
    first reduction runs over whole rows and the second over the few channels per row."""
    channels = x.shape[dim]
    rows = x.movedim(dim, -1)
    lead = sorted(range(rows.dim() - 1), key=rows.stride, reverse=True)
    rows = rows.permute(*lead, rows.dim() - 1)
    k = rows.dim() - 1  # rows' dims k.. lie next to each other in memory
    while k > 0 and (
        rows.shape[k - 1] == 1 or rows.stride(k - 1) == rows.stride(k) * rows.shape[k]
    ):
        k -= 1
    rows = rows.flatten(k)
    outer = tuple(range(k))
    high = (rows.amax(dim=outer) if outer else rows).reshape(-1, channels).amax(0)
    low = (rows.amin(dim=outer) if outer else rows).reshape(-1, channels).amin(0)
    shape = [1] * x.dim()
    shape[dim] = channels
    return high.float().view(shape), low.float().view(shape)


def _dense(x: torch.Tensor) -> bool:
    """No element aliases another (an expanded tensor is not written in place)."""
    return x.is_contiguous() or (
        x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    )


def _shares_storage(x: torch.Tensor, tensors: Tensors) -> bool:
    """Whether ``x`` lies in the memory of one of ``tensors`` (an inner compressor that
    hands back what it stored)."""
    ptr = x.untyped_storage().data_ptr()
    return any(
        isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in tensors
    )


def _exponents(amax: torch.Tensor, ratio: float) -> torch.Tensor:
    """int8 ``e`` per channel: the channel is divided by ``2**e`` (0 within the bound)."""
    bound = amax.flatten().median() * ratio
    bound = torch.maximum(bound, amax.max() / _MAX_SCALE)  # mostly-zero channels
    scale = (amax / bound).nan_to_num_(nan=1.0, posinf=_MAX_SCALE)
    return scale.clamp_(1.0, _MAX_SCALE).log2_().ceil_().to(torch.int8)


def _scale(exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**exponents`` in ``dtype`` (exact: powers of two within the dtype's range)."""
    scale = torch.exp2(exponents)  # (int8 in, the default float dtype out)
    return scale if scale.dtype == dtype else scale.to(dtype)


def _max_exponent(dtype: torch.dtype) -> int:
    """The largest exponent a scale may have in ``dtype`` (fp16: 15), at most _MAX_SCALE's."""
    return min(int(math.log2(torch.finfo(dtype).max)), int(math.log2(_MAX_SCALE)))


def _capped_exponents(amax: torch.Tensor, ratio: float, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_exponents`, at most the dtype's largest power of two (fp16: 2**15), so the
    scale is finite."""
    return _exponents(amax, ratio).clamp_max_(_max_exponent(dtype))


def channel_exponents(x: torch.Tensor, dim: int, ratio: float = OUTLIER_RATIO) -> torch.Tensor:
    """int8 ``e`` per channel of ``x`` along ``dim`` (shaped to broadcast against ``x``): the
    outlier channels' power-of-two scale exponents, 0 for the others."""
    return _capped_exponents(_channel_amax(x, dim), ratio, x.dtype)


class ChannelScales:
    """One layer's channel-scale exponents, found on a step that refreshes them and reused on
    the others while the tensor's channels, dtype and device are the same.

    Not for float16, whose narrow exponent range could underflow a channel whose values
    shrank since (its exponents are found on every step)."""

    __slots__ = ("exponents", "signature")

    def __init__(self) -> None:
        self.exponents: torch.Tensor | None = None
        self.signature: tuple | None = None

    def exponents_for(self, x: torch.Tensor, dim: int, refresh: bool) -> torch.Tensor | None:
        """The exponents to scale ``x`` by: found again when ``refresh`` or when ``x`` differs
        in layout, else the last ones; None for float16 (the packing finds them).

        A packing gets exponents of its own (a copy of the kept ones, or those just found),
        allocated with it either way, so a step keeps the same bytes whether it refreshed;
        the kept ones are a private copy, updated in place (a packing still held, as with
        gradient accumulation, never sees its exponents change)."""
        if x.dtype == torch.float16:
            return None
        signature = (x.dim(), dim, x.shape[dim], x.dtype, x.device)
        if not refresh and self.exponents is not None and signature == self.signature:
            return self.exponents.clone()
        found = channel_exponents(x.detach(), dim)
        if self.exponents is not None and signature == self.signature:
            self.exponents.copy_(found)
        else:
            self.exponents = found.clone()
            self.signature = signature
        return found


def joint_top(a: torch.Tensor, b: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """The ``count`` channels along ``dim`` with the largest ``amax(a) * amax(b)``: those of a
    product ``sum_c a_c b_c`` (attention's ``q k^T``) whose rounding moves it most, to keep
    exact in both factors (an outlier in ``a`` multiplies ``b``'s rounding error)."""
    return joint_top_and_amax(a, b, dim, count)[0]


def joint_top_and_amax(
    a: torch.Tensor, b: torch.Tensor, dim: int, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`joint_top`, and each channel's largest magnitude in ``a`` and in ``b`` (as
    :class:`ChannelScaled` finds them: its ``amax``, so packing ``a`` and ``b`` reads
    neither again)."""
    amax_a, amax_b = _channel_amax(a, dim % a.dim()), _channel_amax(b, dim % b.dim())
    return (amax_a.flatten() * amax_b.flatten()).topk(count).indices, amax_a, amax_b


def exact_channels(channels: int) -> int:
    """How many channels of largest magnitude a tensor with ``channels`` channels keeps exact
    where its backward is nonlinear in it: one per 256 channels (at least one)."""
    return max(1, -(-channels // 256))


def channel_dim(x: torch.Tensor, group_size: int) -> int | None:
    """The channel dim along which ``x``'s quantization groups mix channels, if they do:
    the last of a 2-D or 3-D tensor (``[tokens, features]``, ``[batch, tokens, features]``),
    dim 1 of a 4-D or 5-D one (``[batch, channels, *spatial]``) whose spatial size is not a
    multiple of ``group_size`` (else every group lies inside one channel); else None."""
    if x.dim() in (2, 3):
        return -1 if x.shape[-1] > 1 else None
    if x.dim() in (4, 5):
        spatial = math.prod(x.shape[2:])
        return 1 if spatial % group_size and x.shape[1] > 1 else None
    return None


def scaled(
    comp: Compressor,
    x: torch.Tensor,
    group_size: int,
    exact: bool = False,
    dim: int | None = None,
    scales: ChannelScales | None = None,
    refresh: bool = True,
) -> Compressor:
    """``comp`` wrapped in :class:`ChannelScaled` where ``x``'s groups mix channels
    (``exact``: with :func:`exact_channels` of them kept as they are); ``dim``: the channel
    dim when the caller knows it (else :func:`channel_dim`); ``scales``: the layer's
    exponents, reused unless ``refresh`` (see :meth:`ChannelScales.exponents_for`; not with
    ``exact``)."""
    if dim is None:
        dim = channel_dim(x, group_size)
    if dim is None or x.dim() == 0 or x.shape[dim] < 2:
        return comp
    keep = exact_channels(x.shape[dim]) if exact else 0
    keep = min(keep, x.shape[dim] - 1)
    found = None
    if scales is not None and keep == 0:
        found = scales.exponents_for(x, dim % x.dim(), refresh)
    return ChannelScaled(comp, dim, exact=keep, exponents=found)


@dataclass(frozen=True)
class ChannelScaled(Wrapping):
    """``inner`` applied to ``x`` with its outlier channels along ``dim`` kept apart (see
    the module doc): the ``exact`` largest kept as they are, the others above ``ratio``
    times the median channel scaled down."""

    inner: Compressor
    dim: int = -1
    ratio: float = OUTLIER_RATIO
    exact: int = 0
    # the ``exact`` channels' indices when the caller chose them (attention keeps the same
    # dims of q and k), else the tensor's own largest
    top: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # the scale exponents when the caller has them (see ChannelScales; without ``exact``),
    # else found from the tensor
    exponents: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # each channel's largest magnitude in the tensor to pack, when the caller found it
    # already (joint_top_and_amax), else found from the tensor
    amax: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "channel_scaled"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        dim = self.dim % x.dim()
        extra: tuple[torch.Tensor, ...] = ()
        if self.exponents is not None and not self.exact:
            exponents = self.exponents  # (the layer's, see ChannelScales)
        else:
            amax = _channel_amax(x, dim) if self.amax is None else self.amax
            if self.exact:
                top = amax.flatten().topk(self.exact).indices if self.top is None else self.top
                extra = (x.index_select(dim, top), top)
                amax = amax.index_fill(dim, top, 0)
            exponents = _capped_exponents(amax, self.ratio, x.dtype)
        scaled = x / _scale(exponents, x.dtype)
        if self.exact:  # the exact channels, kept apart, are zeros here (whatever they held)
            scaled.index_fill_(dim, extra[1], 0)
        tensors, meta = self.inner.pack(scaled)
        return (*tensors, exponents, *extra), (meta, len(tensors), dim)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        inner_meta, count, dim = meta
        inner = tuple(tensors[:count])
        x = self.inner.unpack(inner, inner_meta)
        scale = _scale(tensors[count], x.dtype)
        # in place on a fresh unpacking (no second tensor of x's size); never on a stored one
        fresh = _dense(x) and not _shares_storage(x, inner)
        x = x.mul_(scale) if fresh else x * scale
        if self.exact:
            kept, top = tensors[count + 1], tensors[count + 2]
            x = x.index_copy_(dim, top, kept.to(x.dtype))
        return x

    def key(self) -> tuple:
        chosen = None if self.top is None else id(self.top)
        found = None if self.exponents is None else id(self.exponents)
        amax = None if self.amax is None else id(self.amax)
        return (self.name, self.dim, self.ratio, self.exact, chosen, found, amax, *self.inner.key())
