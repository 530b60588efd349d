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
from .quantize import Quantize

__all__ = [
    "OUTLIER_RATIO",
    "SCALES_REFRESH",
    "ChannelScaled",
    "ChannelScales",
    "channel_dim",
    "channel_exponents",
    "exact_channels",
    "found_scales",
    "joint_top",
    "joint_top_and_amax",
    "scaled",
]

OUTLIER_RATIO = 4.0
"""A channel is an outlier when its largest magnitude exceeds this many times the median
channel's; it is then scaled down to that bound."""

_MAX_SCALE = 2.0**20  # a channel is never divided by more (nor by a non-finite scale)

SCALES_REFRESH = 20
"""Scales reused by an owner without statistics steps (a norm's or activation's layer, a
hooks-route save site) are found on its first use and every this many uses after."""


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


def _inner(shape: Any, dim: int) -> int:
    """Elements per channel run along ``dim`` of a tensor of ``shape``, in row-major order."""
    return math.prod(shape[dim + 1 :])


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
    return found_scales(x, dim, ratio, 0)[0]


class ChannelScales:
    """One layer's (or save site's) channel-scale exponents, and with exact channels their
    indices, found on a step that refreshes them and reused on the others while the tensor's
    channels, dtype and device are the same.

    Not for float16, whose narrow exponent range could underflow a channel whose values
    shrank since (its exponents are found on every step)."""

    __slots__ = ("exponents", "signature", "top", "uses")

    def __init__(self) -> None:
        self.exponents: torch.Tensor | None = None
        self.top: torch.Tensor | None = None
        self.signature: tuple | None = None
        self.uses = 0

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to reuse these scales as the uninterrupted run does."""
        sig = self.signature
        return {
            "exponents": self.exponents,
            "top": self.top,
            "uses": self.uses,
            "signature": None if sig is None else [*sig[:3], str(sig[3]), str(sig[4]), *sig[5:]],
        }

    @classmethod
    def from_state_dict(cls, state: Any) -> ChannelScales:
        """Scales from :meth:`state_dict` (TypeError / ValueError naming what is wrong)."""
        if not isinstance(state, dict) or set(state) != {"exponents", "top", "uses", "signature"}:
            raise ValueError(
                f"a ChannelScales state is a dict of exponents, top, uses and "
                f"signature, got {state!r:.200}"
            )
        uses, sig = state["uses"], state["signature"]
        if isinstance(uses, bool) or not isinstance(uses, int) or uses < 0:
            raise ValueError(f"ChannelScales state: uses must be an int >= 0, got {uses!r}")
        scales = cls()
        scales.uses = uses
        if sig is None:
            return scales
        exponents, top = state["exponents"], state["top"]
        if not isinstance(exponents, torch.Tensor) or exponents.dtype != torch.int8:
            raise ValueError(
                f"ChannelScales state: exponents must be an int8 tensor, got {exponents!r:.80}"
            )
        if top is not None and not isinstance(top, torch.Tensor):
            raise ValueError(f"ChannelScales state: top must be a tensor or None, got {top!r:.80}")
        if not isinstance(sig, (list, tuple)) or len(sig) != 7:
            raise ValueError(f"ChannelScales state: bad signature {sig!r}")
        dtype = getattr(torch, str(sig[3]).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"ChannelScales state: unknown dtype {sig[3]!r}")
        device = torch.device(sig[4])
        # copies: refreshes update them in place, never the state handed in
        scales.exponents = exponents.to(device).clone()
        scales.top = None if top is None else top.to(device).clone()
        scales.signature = (
            int(sig[0]),
            int(sig[1]),
            int(sig[2]),
            dtype,
            device,
            int(sig[5]),
            float(sig[6]),
        )
        return scales

    def due(self, every: int | None = None) -> bool:
        """Whether this use should find the scales again: the first and every ``every``-th
        (default :data:`SCALES_REFRESH`; for owners without statistics steps of their own
        to refresh on)."""
        due = self.uses % (SCALES_REFRESH if every is None else every) == 0
        self.uses += 1
        return due

    def exponents_for(self, x: torch.Tensor, dim: int, refresh: bool) -> torch.Tensor | None:
        """The exponents to scale ``x`` by (no exact channels): see :meth:`scales_for`."""
        found = self.scales_for(x, dim, refresh)
        return None if found is None else found[0]

    def scales_for(
        self,
        x: torch.Tensor,
        dim: int,
        refresh: bool,
        exact: int = 0,
        ratio: float = OUTLIER_RATIO,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The exponents to scale ``x`` by and the indices of its ``exact`` channels kept as
        they are (None without): found again when ``refresh`` or when ``x`` differs in
        layout, else the last ones; None for float16 (the packing finds them).

        A packing gets tensors of its own (copies of the kept ones, or those just found),
        allocated with it either way, so a step keeps the same bytes whether it refreshed;
        the kept ones are private copies, updated in place (a packing still held, as with
        gradient accumulation, never sees its exponents change). Reused ones are stale by
        a few steps: the rounding stays unbiased and the exact channels exact, only the
        choice of which channels to scale or keep may lag the tensor's."""
        if x.dtype == torch.float16:
            return None
        signature = (x.dim(), dim, x.shape[dim], x.dtype, x.device, exact, ratio)
        if not refresh and self.exponents is not None and signature == self.signature:
            return self.exponents.clone(), None if self.top is None else self.top.clone()
        exponents, top = found_scales(x.detach(), dim, ratio, exact)
        if self.exponents is not None and signature == self.signature:
            self.exponents.copy_(exponents)
            if top is not None and self.top is not None:
                self.top.copy_(top)
        else:
            self.exponents = exponents.clone()
            self.top = None if top is None else top.clone()
            self.signature = signature
        return exponents, top


def found_scales(
    x: torch.Tensor,
    dim: int,
    ratio: float,
    exact: int,
    amax: torch.Tensor | None = None,
    top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x``'s scale exponents along ``dim`` and, with ``exact``, the indices of its
    ``exact`` channels of largest magnitude (``top`` when given), left out of the
    exponents' median; ``amax``: the channel magnitudes when the caller has them."""
    amax = _channel_amax(x, dim) if amax is None else amax
    if exact:
        top = amax.flatten().topk(exact).indices if top is None else top
        amax = amax.index_fill(dim, top, 0)
    return _capped_exponents(amax, ratio, x.dtype), top if exact else None


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
    dim when the caller knows it (else :func:`channel_dim`); ``scales``: the owner's
    exponents (and exact channels), reused by the packing unless ``refresh`` (see
    :meth:`ChannelScales.scales_for`)."""
    if dim is None:
        dim = channel_dim(x, group_size)
    if dim is None or x.dim() == 0 or x.shape[dim] < 2:
        return comp
    keep = exact_channels(x.shape[dim]) if exact else 0
    keep = min(keep, x.shape[dim] - 1)
    return ChannelScaled(comp, dim, exact=keep, scales=scales, refresh=refresh)


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
    # the scale exponents when the caller has them (with ``exact``, beside ``top``), else
    # the owner's ``scales`` or found from the tensor
    exponents: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # each channel's largest magnitude in the tensor to pack, when the caller found it
    # already (joint_top_and_amax), else found from the tensor
    amax: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # the owner's scales, reused by the packing unless ``refresh`` (found from the tensor
    # packed, kept for the next packings)
    scales: ChannelScales | None = field(default=None, compare=False, repr=False)
    refresh: bool = field(default=True, compare=False, repr=False)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "channel_scaled"

    def pack(self, x: torch.Tensor) -> tuple[Tensors, Any]:
        dim = self.dim % x.dim()
        found = None
        if self.exponents is not None and (not self.exact or self.top is not None):
            found = self.exponents, self.top  # (given by the caller)
        elif self.scales is not None:  # the owner's (None for float16: found here)
            found = self.scales.scales_for(x, dim, self.refresh, self.exact, self.ratio)
        if found is None:
            found = found_scales(x, dim, self.ratio, self.exact, self.amax, self.top)
        exponents, top = found
        extra: tuple[torch.Tensor, ...] = ()
        if self.exact:  # kept apart: the packed tensor holds zeros there (whatever they held)
            assert top is not None
            extra = (x.index_select(dim, top), top)
        if type(self.inner) is Quantize:  # one pass: x times 2**-e (0 at the exact channels)
            multipliers = torch.exp2(exponents.flatten().neg().float())
            if self.exact:
                multipliers.index_fill_(0, top, 0.0)
            tensors, meta = self.inner.pack_scaled(x, multipliers, _inner(x.shape, dim))
        else:
            scaled = x / _scale(exponents, x.dtype)
            if self.exact:
                scaled.index_fill_(dim, top, 0)
            tensors, meta = self.inner.pack(scaled)
        return (*tensors, exponents, *extra), (meta, len(tensors), dim)

    def unpack(self, tensors: Tensors, meta: Any) -> torch.Tensor:
        inner_meta, count, dim = meta
        inner = tuple(tensors[:count])
        if type(self.inner) is Quantize:  # dequantized and times 2**e in one pass
            multipliers = torch.exp2(tensors[count].flatten().float())
            x = self.inner.unpack_scaled(inner, inner_meta, multipliers, _inner(inner_meta[0], dim))
        else:
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
        owner = None if self.scales is None else id(self.scales)
        return (
            self.name,
            self.dim,
            self.ratio,
            self.exact,
            chosen,
            found,
            amax,
            owner,
            *self.inner.key(),
        )
