"""The optimization levels of both routes, and the process-wide configuration.

Each route has its own table, and no name is in both:

* the layer-swap route (``convert``, Q-layers): ``L0`` .. ``L5`` in :data:`LEVELS` (after
  ActNN's), resolved by :func:`level_spec`. ``actcore.set_optimization_level("L3")`` picks
  the level of Q-layers that ``convert(model, level=...)`` gave none;
* the saved-tensor hooks route (``Controller``, ``compress_saved_tensors``): ``G0`` ..
  ``G3`` in :data:`HOOK_LEVELS` (GACT's ``L0`` .. ``L3``, renamed so that a name means one
  thing), resolved by :func:`hook_level`.

A name of the other route is refused with a ValueError that says which route it belongs to.

Notes per level: L3 and above attach an :class:`actcore.adaptive.AdaptiveBits` (per-sample
and per-layer bits around the 2-bit average). L3.1 only changes the convolution backward
(micro-batches, same gradients up to summation order). L4, L5 and ``swap`` move saved
tensors of CUDA activations to pinned host memory; activations already on the CPU have
nowhere to go, so there L4/L5 store exactly what L3 stores and ``swap`` what L0 stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

__all__ = [
    "HOOK_LEVELS",
    "LEVELS",
    "Config",
    "HookLevel",
    "LevelSpec",
    "config",
    "hook_level",
    "level_spec",
    "lookup_level",
    "set_optimization_level",
]

_Level = TypeVar("_Level")

_SAME = -1  # a per-kind bits field that follows another one (see LevelSpec)


@dataclass(frozen=True)
class LevelSpec:
    """What one optimization level does to each kind of tensor a model keeps for backward.

    ``conv_bits``: inputs of conv/linear layers; ``norm_bits``:
    inputs of batch norm; ``row_norm_bits``: inputs of norms over each sample's features
    (layer, group, RMS norms, and ``F.normalize``'s unit vectors); ``activation_bits``:
    inputs of smooth activations (their outputs derive from them); ``other_bits``: every
    other tensor the forward saves (attention's q, k, v, products' operands, inline
    attention scores, what activation checkpointing keeps...). None
    keeps a kind in full precision; the last three follow ``norm_bits``/``conv_bits``
    unless given.
    """

    name: str
    conv_bits: int | None  # inputs of conv/linear layers; None keeps full precision
    norm_bits: int | None  # inputs of batch-norm layers
    zero_value: bool = False  # a ReLU output saved by the next layer keeps only its nonzeros
    adaptive: bool = False  # per-sample / per-layer bits around the average
    micro_batches: int = 1  # conv backward in this many micro-batches (cuts workspace)
    swap: bool = False  # saved tensors go to pinned CPU memory, prefetched in backward
    expandable_segments: bool = False  # PyTorch's allocator setting against fragmentation
    summary: str = ""
    row_norm_bits: int | None = _SAME  # layer / group / RMS norm inputs (default: norm_bits)
    activation_bits: int | None = _SAME  # smooth-activation inputs (default: conv_bits)
    other_bits: int | None = _SAME  # everything else the forward saves (default: conv_bits)

    def __post_init__(self) -> None:
        for name, same in (
            ("row_norm_bits", self.norm_bits),
            ("activation_bits", self.conv_bits),
            ("other_bits", self.conv_bits),
        ):
            if getattr(self, name) == _SAME:
                object.__setattr__(self, name, same)

    @property
    def packs(self) -> bool:
        """Whether the level changes what a forward keeps at all (it compresses or swaps);
        False: plain PyTorch (L0)."""
        return self.compresses or self.swap

    @property
    def compresses(self) -> bool:
        return any(
            b is not None
            for b in (
                self.conv_bits,
                self.norm_bits,
                self.row_norm_bits,
                self.activation_bits,
                self.other_bits,
            )
        )


_L3 = LevelSpec(
    "L3",
    conv_bits=2,
    norm_bits=2,
    zero_value=True,
    adaptive=True,
    summary=(
        "conv/linear and batch-norm inputs at 2 bits on average, per-sample/per-layer "
        "adaptive; ReLU outputs keep only nonzeros; row norms, activations and the rest at 4"
    ),
    row_norm_bits=4,
    activation_bits=4,
    other_bits=4,
)

LEVELS: dict[str, LevelSpec] = {
    spec.name: spec
    for spec in (
        LevelSpec(
            "L0", None, None, summary="no compression; masks and pooling indices still compact"
        ),
        LevelSpec(
            "L1",
            4,
            None,
            summary="4-bit conv/linear inputs, normalization in full precision",
            row_norm_bits=None,
        ),
        LevelSpec("L2", 4, 4, summary="4-bit conv/linear and normalization inputs"),
        _L3,
        replace(_L3, name="L3.1", micro_batches=4, summary="L3 + conv backward in 4 micro-batches"),
        replace(
            _L3, name="L4", swap=True, summary="L3 + packed tensors swapped to pinned CPU memory"
        ),
        replace(
            _L3,
            name="L5",
            swap=True,
            expandable_segments=True,
            summary="L4 + the expandable_segments CUDA allocator against fragmentation",
        ),
        LevelSpec(
            "swap", None, None, swap=True, summary="full-precision activations swapped to CPU"
        ),
    )
}


@dataclass(frozen=True)
class HookLevel:
    """One optimization level of the saved-tensor hooks route (``Controller(level=...)``)."""

    name: str
    bits: int | None  # fixed bits, or the average-bits budget when ``auto``; None: no compression
    auto: bool = False  # per-tensor bits from sensitivity
    swap: bool = False  # packed tensors moved to pinned CPU memory (GPU only)
    summary: str = ""


HOOK_LEVELS: dict[str, HookLevel] = {
    lv.name: lv
    for lv in (
        HookLevel("G0", None, summary="no compression (gradients bitwise equal to no hooks)"),
        HookLevel("G1", 4, summary="every saved activation at 4 bits"),
        HookLevel("G1.1", 8, summary="every saved activation at 8 bits"),
        HookLevel("G1.2", 2, summary="every saved activation at 2 bits"),
        HookLevel("G2", 4, auto=True, summary="auto precision: 4 bits on average"),
        HookLevel("G2.1", 3, auto=True, summary="auto precision: 3 bits on average"),
        HookLevel("G2.2", 2, auto=True, summary="auto precision: 2 bits on average"),
        HookLevel(
            "G3",
            4,
            auto=True,
            swap=True,
            summary="auto precision, 4 bits on average, packed data swapped to pinned CPU memory",
        ),
    )
}

_LAYER_ROUTE = "the layer-swap route (actcore.convert, set_optimization_level)"
_HOOKS_ROUTE = "the saved-tensor hooks route (actcore.Controller, compress_saved_tensors)"


def level_spec(level: str | LevelSpec) -> LevelSpec:
    """The :class:`LevelSpec` of ``level``, or ValueError listing the valid names (and
    saying so when ``level`` is a name of the hooks route, :data:`HOOK_LEVELS`)."""
    return lookup_level(LEVELS, level, LevelSpec, "optimization level", (HOOK_LEVELS, _HOOKS_ROUTE))


def hook_level(level: str | HookLevel) -> HookLevel:
    """The :class:`HookLevel` named ``level``, or ValueError listing the valid names (and
    saying so when ``level`` is a name of the layer route, :data:`LEVELS`)."""
    return lookup_level(HOOK_LEVELS, level, HookLevel, "level", (LEVELS, _LAYER_ROUTE))


def lookup_level(
    table: Mapping[str, _Level],
    level: object,
    kind: type[_Level],
    what: str,
    other: tuple[Mapping[str, object], str] | None = None,
) -> _Level:
    """``level`` itself when it is a ``kind``, else ``table[level]``; an unknown name is a
    ValueError naming it (as a ``what``) and the valid ones, and, when it is in ``other``'s
    table, that route (``other``: the other route's table and its description)."""
    if isinstance(level, kind):
        return level
    try:
        return table[level]  # type: ignore[index]
    except (KeyError, TypeError):
        valid = ", ".join(table)
        where = ""
        if other is not None and isinstance(level, str) and level in other[0]:
            where = f" ({level!r} is a level of {other[1]})"
        raise ValueError(f"unknown {what} {level!r}{where}; valid levels: {valid}") from None


@dataclass
class Config:
    """Process-wide settings (ActNN's ``actnn.config``).

    ``level`` is the name of the level of layers converted without one; assigning it
    resolves the name once (ValueError if unknown) into ``spec``, which the hot path reads.
    """

    level: str = "L3"
    group_size: int = 256
    stochastic: bool = True
    # skip compression of tensors smaller than this many elements (metadata would dominate)
    min_numel: int = 1024
    # smooth activations keep their derivative, stochastically rounded (an unbiased input
    # gradient; the next layer keeps its own copy of the output), instead of their input
    # recomputed in backward (fewer bytes and less noise, a small bias: actcore.layers.recompute)
    keep_derivatives: bool = False
    extra: dict = field(default_factory=dict)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "level":
            spec = level_spec(value)  # type: ignore[arg-type]
            object.__setattr__(self, "_spec", spec)
            value = spec.name
        object.__setattr__(self, name, value)

    @property
    def spec(self) -> LevelSpec:
        """The resolved :class:`LevelSpec` of ``level``."""
        return self._spec  # type: ignore[attr-defined]


config = Config()


def set_optimization_level(level: str | LevelSpec) -> None:
    """Set the level used by Q-layers that were not given one (ValueError if unknown)."""
    config.level = level  # resolved once (ValueError if unknown)
    spec = config.spec
    if spec.expandable_segments:
        from .allocator import enable_expandable_segments

        enable_expandable_segments()
