"""DropIT: keep only the largest-magnitude part of the inputs that Linear and conv layers save.

A Linear or conv layer keeps its input alive until backward only to compute its weight
gradient. DropIT (Chen et al., ICLR 2023) drops the ``gamma`` fraction of smallest-magnitude
elements of that saved input ("min-k") and computes the weight gradient from what is left::

    from actcore.dropit import to_dropit
    report = to_dropit(model, strategy="mink", gamma=0.9)   # swaps layers in place
    print(report)                                           # converted / skipped layers

Semantics of a converted layer (while autograd records; under ``no_grad`` or with
``gamma == 0`` it is exactly the plain layer):

* forward output: exactly the plain layer's (same aten ops, also under autocast);
* input gradient: exact (it needs only the weight, which is never dropped);
* bias gradient: exact;
* weight gradient: computed from the input with all but its ``k`` largest-magnitude elements
  set to zero, ``k = numel - floor(gamma * numel)``. Exactly ``k`` elements are kept
  (``torch.topk``; among equal magnitudes at the threshold the choice is topk's). For convs,
  "the input" is what torch convolves: after the explicit padding torch itself applies
  (padding modes other than ``"zeros"``, the odd extra element of ``padding="same"``).
* not twice differentiable (``once_differentiable``).

Layers: ``nn.Linear``, ``nn.Conv1d/2d/3d`` (exact classes, not subclasses) and transformers'
``Conv1D`` (GPT-2), the latter only when ``transformers.pytorch_utils`` is already imported:
this module never imports transformers.

Strategies: ``"mink"`` (DropIT's default) ranks the whole input tensor of the layer at once;
``"mink_sample"`` ranks each sample (index of dim 0) on its own, so every sample keeps the same
fraction.

What is stored: the kept values in the dtype the layer computes in (the autocast dtype under
autocast, as autocast would save), plus their positions as a
1-bit bitmap (:func:`actcore.ops.pack_mask`) or as int16/int32 offsets, whichever is smaller
(offsets win only when fewer than 1/16 or 1/32 of the elements are kept); never int64. For fp32
and ``gamma=0.9`` that is ``0.1 * 4 + 1/8 = 0.525`` bytes per element instead of 4 (13%).

Skipping: modules whose dotted name matches a ``skip`` pattern (``fnmatch`` syntax, e.g.
``"head"`` or ``"layer1.*"``), and modules with an attribute ``dropit_skip = True``, stay plain,
and so does everything inside such a module.

Whether a saving is real: a layer's input is often kept alive for backward by another node
too, e.g. the output of a ``ReLU`` (in-place or not), which the ReLU saves for its own
backward. Compressing such an input frees nothing and adds the compressed copy.
:func:`measure_saving` (or ``to_dropit(..., example_inputs=...)``) runs the model under
:mod:`actcore.memory` with and without DropIT and reports, per layer, the bytes really freed;
layers whose saving is not positive are listed in ``not_real`` (``revert_unreal=True`` makes
them plain again). A layer reading the model's own input is counted as a real saving, as
:mod:`actcore.memory` counts it; it is real only if the caller drops the batch before backward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import math
import numbers
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from actcore import ops
from actcore.walker import Left, walk

__all__ = [
    "STRATEGIES",
    "DropITConv1d",
    "DropITConv2d",
    "DropITConv3d",
    "DropITLinear",
    "DropITReport",
    "Kept",
    "LayerSaving",
    "SavingReport",
    "drop_mink",
    "is_dropit",
    "measure_saving",
    "num_kept",
    "remove_dropit",
    "to_dropit",
]

STRATEGIES: dict[str, str] = {
    "mink": "drop the gamma fraction of smallest-magnitude elements of the whole input",
    "mink_sample": "drop the gamma fraction of smallest-magnitude elements of each sample",
}

_INDEX_DTYPES = ((torch.int16, 2**15 - 1), (torch.int32, 2**31 - 1))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_gamma(gamma: object) -> float:
    if (
        isinstance(gamma, bool)
        or not isinstance(gamma, numbers.Real)
        or not math.isfinite(float(gamma))
        or not 0.0 <= float(gamma) < 1.0
    ):
        raise ValueError(
            f"gamma must be a number in [0, 1) (the fraction of input elements dropped), got "
            f"{gamma!r}; to train without a weight gradient freeze the layer instead"
        )
    return float(gamma)


def _check_strategy(strategy: object) -> str:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(
            f"unknown DropIT strategy {strategy!r}; expected one of "
            f"{', '.join(repr(s) for s in STRATEGIES)}"
        )
    return strategy


# --------------------------------------------------------------------------------------------
# The min-k compressor
# --------------------------------------------------------------------------------------------


def num_kept(numel: int, gamma: float) -> int:
    """Elements min-k keeps out of ``numel``: all but ``floor(gamma * numel)`` (at least 1)."""
    gamma = _check_gamma(gamma)
    if numel <= 0:
        return 0
    dropped = gamma * numel
    dropped = math.floor(dropped + 1e-9 * max(1.0, dropped))  # 0.29 * 100 drops 29, not 28
    return numel - min(dropped, numel - 1)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a :class:`Kept` is laid out: what the tensors mean, without the tensors."""

    encoding: str  # "dense" (nothing dropped), "bitmap", "int16" or "int32"
    shape: torch.Size
    rows: int  # 1 for "mink", the batch size for "mink_sample"
    kept: int  # kept elements per row
    memory_format: torch.memory_format


@dataclasses.dataclass(frozen=True, eq=False)
class Kept:
    """What min-k keeps of a tensor: its kept values and where they were.

    ``values`` holds the kept elements (row-major order for a bitmap, offset order otherwise);
    ``index`` is a uint8 bitmap from :func:`actcore.ops.pack_mask`, int16/int32 offsets within
    each row, or ``None`` when nothing was dropped (then ``values`` is the tensor itself).
    """

    values: Tensor
    index: Tensor | None
    layout: _Layout

    @property
    def encoding(self) -> str:
        """``"dense"``, ``"bitmap"``, ``"int16"`` or ``"int32"``."""
        return self.layout.encoding

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        """The stored tensors (what :mod:`actcore.memory` counts)."""
        return (self.values,) if self.index is None else (self.values, self.index)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], layout: _Layout) -> Kept:
        """Rebuild from :meth:`tensors` and the layout (after ``save_for_backward``)."""
        index = tensors[1] if len(tensors) > 1 else None
        return cls(tensors[0], index, layout)

    def restore(self) -> Tensor:
        """The original tensor with the dropped elements set to zero."""
        lay = self.layout
        if self.index is None:
            return self.values
        numel = lay.shape.numel()
        if lay.encoding == "bitmap":
            mask = ops.unpack_mask(self.index, (numel,))
            dense = self.values.new_zeros(numel).masked_scatter_(mask, self.values)
        else:
            dense = self.values.new_zeros(lay.rows, numel // lay.rows)
            dense.scatter_(1, self.index.long(), self.values.view(lay.rows, lay.kept))
        dense = dense.view(lay.shape)
        if lay.memory_format != torch.contiguous_format:
            dense = dense.contiguous(memory_format=lay.memory_format)
        return dense


def _memory_format(x: Tensor) -> torch.memory_format:
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _encoding(rows: int, row_len: int, kept: int) -> str:
    """The cheapest position encoding: a bitmap or narrow offsets (ties go to the bitmap)."""
    best, best_bytes = "bitmap", (rows * row_len + 7) // 8
    for dtype, limit in _INDEX_DTYPES:
        nbytes = rows * kept * (torch.iinfo(dtype).bits // 8)
        if row_len <= limit and nbytes < best_bytes:
            best, best_bytes = str(dtype).removeprefix("torch."), nbytes
    return best


def drop_mink(x: Tensor, gamma: float, *, rows: int = 1) -> Kept:
    """Keep the ``num_kept(numel / rows, gamma)`` largest-magnitude elements of each row.

    ``x`` is seen as ``rows`` rows in row-major order (``rows=1``: the whole tensor, DropIT's
    "mink"; ``rows=x.shape[0]``: each sample). NaNs count as largest and are kept.
    """
    gamma = _check_gamma(gamma)
    numel = x.numel()
    if not isinstance(rows, int) or rows < 1 or numel % rows:
        raise ValueError(f"rows must be a positive divisor of x.numel()={numel}, got {rows!r}")
    row_len = numel // rows
    kept = num_kept(row_len, gamma)
    fmt = _memory_format(x)
    if kept == row_len:
        return Kept(x, None, _Layout("dense", x.shape, rows, kept, fmt))
    flat = x.reshape(rows, row_len)
    top = flat.abs().topk(kept, dim=1, sorted=False).indices
    encoding = _encoding(rows, row_len, kept)
    layout = _Layout(encoding, x.shape, rows, kept, fmt)
    if encoding == "bitmap":
        mask = torch.zeros(rows, row_len, dtype=torch.bool, device=x.device)
        mask.scatter_(1, top, True)
        return Kept(flat[mask], ops.pack_mask(mask), layout)
    top = top.sort(dim=1).values
    index = top.to(torch.int16 if encoding == "int16" else torch.int32)
    return Kept(flat.gather(1, top).reshape(-1), index, layout)


# --------------------------------------------------------------------------------------------
# Layer math: one description per layer family, one autograd Function for all
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LinearOp:
    """``y = x W^T + b`` (nn.Linear, weight (out, in)) or ``x W + b`` (HF Conv1D, (in, out))."""

    weight_in_out: bool = False

    def rows(self, x: Tensor) -> int:
        return x.shape[0] if x.dim() >= 2 else 1

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.weight_in_out:
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.mm(weight) if bias is None else torch.addmm(bias, x2, weight)
        return y.view(*x.shape[:-1], weight.shape[-1])

    def backward(
        self, grad: Tensor, x: Tensor | None, x_shape: torch.Size, weight: Tensor, needs: Any
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if needs[0]:
            gx = g2.mm(weight.t() if self.weight_in_out else weight).view(x_shape)
        if needs[1]:
            assert x is not None
            x2 = x.reshape(-1, x.shape[-1])
            gw = x2.t().mm(g2) if self.weight_in_out else g2.t().mm(x2)
        if needs[2]:
            gb = g2.sum(0)
        return gx, gw, gb


@dataclasses.dataclass(frozen=True)
class _ConvOp:
    """Batched ``aten.convolution`` with integer padding (any number of spatial dims)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def rows(self, x: Tensor) -> int:
        return x.shape[0]

    def _args(self) -> tuple[Any, ...]:
        zeros = [0] * len(self.stride)
        return list(self.stride), list(self.padding), list(self.dilation), False, zeros

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.aten.convolution(x, weight, bias, *self._args(), self.groups)

    def backward(
        self, grad: Tensor, x: Tensor | None, x_shape: torch.Size, weight: Tensor, needs: Any
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if x is None:  # input gradient only: it depends on the input's shape, not its values
            x = grad.new_zeros(()).expand(x_shape)
        bias_sizes = [weight.shape[0]] if needs[2] else None
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, weight, bias_sizes, *self._args(), self.groups, list(needs)
        )
        return gx, gw, gb


class _DropITFunction(torch.autograd.Function):
    """The layer's exact output; saves the weight and min-k of the input (for the weight grad)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        op: _LinearOp | _ConvOp,
        gamma: float,
        per_sample: bool,
    ) -> Tensor:
        out = op.forward(x, weight, bias)
        ctx.op, ctx.x_shape, ctx.layout = op, x.shape, None
        kept: tuple[Tensor, ...] = ()
        if ctx.needs_input_grad[1]:
            rows = op.rows(x) if per_sample and x.numel() else 1
            dropped = drop_mink(x, gamma, rows=rows)
            ctx.layout, kept = dropped.layout, dropped.tensors()
        ctx.save_for_backward(weight, *kept)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, *kept = ctx.saved_tensors
        x = Kept.from_tensors(kept, ctx.layout).restore() if ctx.layout is not None else None
        needs = ctx.needs_input_grad[:3]
        gx, gw, gb = ctx.op.backward(grad, x, ctx.x_shape, weight, needs)
        return gx, gw, gb, None, None, None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        pass
    return None


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Autocast's rule: floating tensors other than float64 go to the autocast dtype."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class _DropITMixin(nn.Module):
    """Shared behaviour of the DropIT layers (put before the torch class in the bases)."""

    _dropit_base: type[nn.Module]
    _dropit_active = True  # measure_saving turns layers off for a comparison run
    dropit_gamma: float
    dropit_strategy: str

    def __init__(self, *args: Any, gamma: float = 0.9, strategy: str = "mink", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dropit_configure(strategy, gamma)

    def dropit_configure(self, strategy: str, gamma: float) -> None:
        """Set the strategy and dropping rate (validated)."""
        self.dropit_strategy = _check_strategy(strategy)
        self.dropit_gamma = _check_gamma(gamma)

    def _dropit_engaged(self, x: Tensor) -> bool:
        if not (self._dropit_active and self.dropit_gamma > 0 and torch.is_grad_enabled()):
            return False
        bias = getattr(self, "bias", None)
        return bool(
            self.weight.requires_grad
            or x.requires_grad
            or (bias is not None and bias.requires_grad)
        )

    def forward(self, input: Tensor) -> Tensor:
        if not self._dropit_engaged(input):
            return super().forward(input)
        x, weight, bias = input, self.weight, self.bias
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:  # cast as autocast would, so the Function sees one dtype
            x, weight, bias = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        return self._dropit_apply(x, weight, bias)

    def _dropit_run(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, op: _LinearOp | _ConvOp
    ) -> Tensor:
        per_sample = self.dropit_strategy == "mink_sample"
        return _DropITFunction.apply(x, weight, bias, op, self.dropit_gamma, per_sample)

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropit={self.dropit_strategy}(gamma={self.dropit_gamma})"


class DropITLinear(_DropITMixin, nn.Linear):
    """``nn.Linear`` whose saved input is min-k sparsified (extra kwargs ``gamma``, ``strategy``)."""

    _dropit_base = nn.Linear

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._dropit_run(x, weight, bias, _LinearOp())


class _DropITConvNd(_DropITMixin):
    """Conv layers: padding modes and string padding resolved as torch does, then one op."""

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        dims = weight.dim() - 2
        unbatched = x.dim() == dims + 1
        if unbatched:
            x = x.unsqueeze(0)
        x, padding = self._dropit_pad(x, dims)
        op = _ConvOp(tuple(self.stride), padding, tuple(self.dilation), self.groups)
        out = self._dropit_run(x, weight, bias, op)
        return out.squeeze(0) if unbatched else out

    def _dropit_pad(self, x: Tensor, dims: int) -> tuple[Tensor, tuple[int, ...]]:
        """Explicit padding the convolution cannot do itself, and the integer padding left."""
        if self.padding_mode != "zeros":
            pad = self._reversed_padding_repeated_twice
            return F.pad(x, pad, mode=self.padding_mode), (0,) * dims
        if not isinstance(self.padding, str):
            return x, tuple(self.padding)
        if self.padding == "valid":
            return x, (0,) * dims
        # "same": total dilation * (kernel - 1) per dim; an odd extra element goes on the right
        totals = [self.dilation[i] * (self.kernel_size[i] - 1) for i in range(dims)]
        extra = [0] * (2 * dims)
        for i, total in enumerate(totals):
            extra[2 * (dims - 1 - i) + 1] = total % 2
        if any(extra):
            x = F.pad(x, extra)
        return x, tuple(total // 2 for total in totals)


class DropITConv1d(_DropITConvNd, nn.Conv1d):
    """``nn.Conv1d`` whose saved input is min-k sparsified."""

    _dropit_base = nn.Conv1d


class DropITConv2d(_DropITConvNd, nn.Conv2d):
    """``nn.Conv2d`` whose saved input is min-k sparsified."""

    _dropit_base = nn.Conv2d


class DropITConv3d(_DropITConvNd, nn.Conv3d):
    """``nn.Conv3d`` whose saved input is min-k sparsified."""

    _dropit_base = nn.Conv3d


class _DropITHFConv1D(_DropITMixin):
    """transformers' ``Conv1D`` (GPT-2): ``x @ W + b`` with the weight stored (in, out)."""

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._dropit_run(x, weight, bias, _LinearOp(weight_in_out=True))


_HF_CLASSES: dict[type, type] = {}


def _hf_conv1d_class(base: type) -> type:
    """The DropIT subclass of a transformers ``Conv1D`` class (made once, importable by name)."""
    cls = _HF_CLASSES.get(base)
    if cls is None:
        name = "DropITConv1D"
        cls = type(name, (_DropITHFConv1D, base), {"_dropit_base": base, "__module__": __name__})
        if name not in globals():  # keep it picklable by qualified name
            globals()[name] = cls
            cls.__qualname__ = name
        else:  # pragma: no cover - a second transformers Conv1D class (module reloaded)
            cls.__qualname__ = f"_HF_CLASSES[{len(_HF_CLASSES)}]"
        _HF_CLASSES[base] = cls
    return cls


def _conversions() -> dict[type, type]:
    """Exact torch class -> DropIT class; HF Conv1D only if transformers is already loaded."""
    table: dict[type, type] = {
        nn.Linear: DropITLinear,
        nn.Conv1d: DropITConv1d,
        nn.Conv2d: DropITConv2d,
        nn.Conv3d: DropITConv3d,
    }
    if "transformers" in sys.modules:
        hf_conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
        if isinstance(hf_conv1d, type) and issubclass(hf_conv1d, nn.Module):
            table[hf_conv1d] = _hf_conv1d_class(hf_conv1d)
    return table


def _make_plain(module: nn.Module) -> None:
    """Turn a DropIT layer back into its torch class (parameters untouched)."""
    module.__class__ = module._dropit_base
    for attr in ("dropit_gamma", "dropit_strategy", "_dropit_active"):
        module.__dict__.pop(attr, None)


def is_dropit(module: nn.Module) -> bool:
    """True for a DropIT layer."""
    return isinstance(module, _DropITMixin)


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DropITReport:
    """What :func:`to_dropit` did.

    Attributes:
        strategy, gamma: the settings applied.
        converted: names of the layers that run DropIT now (newly converted or updated).
        skipped: supported-looking layers left plain, by name, with the reason.
        saving: the :class:`SavingReport` of an example run, if ``example_inputs`` was given.
        model: the converted model (``model`` itself when ``inplace=True``).
    """

    strategy: str
    gamma: float
    converted: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    saving: SavingReport | None = None
    model: nn.Module | None = dataclasses.field(default=None, repr=False)

    @property
    def not_real(self) -> list[str]:
        """Converted layers whose measured saving is not positive (needs ``saving``)."""
        return [] if self.saving is None else self.saving.not_real

    def __str__(self) -> str:
        lines = [
            f"DropIT {self.strategy}(gamma={self.gamma}): {len(self.converted)} layer(s) "
            f"converted, {len(self.skipped)} skipped"
        ]
        lines += [f"  converted {name or '(root)'}" for name in self.converted]
        lines += [f"  skipped   {name or '(root)'}: {why}" for name, why in self.skipped.items()]
        if self.saving is not None:
            lines.append(str(self.saving))
        elif self.converted:
            lines.append("saving not measured (pass example_inputs, or call measure_saving)")
        return "\n".join(lines)


def _skip_patterns(skip: str | Iterable[str]) -> tuple[str, ...]:
    patterns = (skip,) if isinstance(skip, str) else tuple(skip)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"skip must hold module-name patterns (str), got {pattern!r}")
    return patterns


def _own_skip_reason(name: str, module: nn.Module, patterns: tuple[str, ...]) -> str | None:
    if getattr(module, "dropit_skip", False):
        return "dropit_skip is set"
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return f"name matches skip pattern {pattern!r}"
    return None


def to_dropit(
    model: nn.Module,
    strategy: str = "mink",
    gamma: float = 0.9,
    *,
    skip: str | Iterable[str] = (),
    inplace: bool = True,
    example_inputs: Any = None,
    revert_unreal: bool = False,
) -> DropITReport:
    """Swap Linear, Conv1d/2d/3d (and transformers' Conv1D) for their DropIT subclasses.

    Converted modules stay instances of their torch class, keep their parameter objects,
    ``state_dict`` keys, device and dtype (the swap changes only the class and adds the
    ``dropit_gamma`` / ``dropit_strategy`` attributes). Only exact classes are converted; their
    subclasses (e.g. ``LazyLinear``) are reported as skipped. Calling it again updates the
    settings (idempotent); an already converted layer that is now skipped is made plain again.

    Args:
        model: the model (a supported layer itself is converted too).
        strategy: ``"mink"`` or ``"mink_sample"`` (see :data:`STRATEGIES`).
        gamma: fraction of each saved input dropped, in [0, 1); 0 means the plain layer.
        skip: ``fnmatch`` patterns of dotted module names to leave plain, with everything
            inside them; modules with ``dropit_skip = True`` are left plain the same way.
        inplace: convert ``model`` itself; with ``False`` a deep copy is converted.
        example_inputs: a tensor or a tuple of positional inputs; when given,
            :func:`measure_saving` runs on them and its result is ``report.saving``.
        revert_unreal: with ``example_inputs``, make the layers whose measured saving is not
            positive plain again (listed in ``skipped``), then measure once more.

    Returns:
        A :class:`DropITReport` (``report.model`` is the converted model).
    """
    strategy = _check_strategy(strategy)
    gamma = _check_gamma(gamma)
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_dropit takes an nn.Module, got {type(model).__name__}")
    patterns = _skip_patterns(skip)
    if not inplace:
        model = copy.deepcopy(model)
    table = _conversions()
    supported = tuple(table)
    report = DropITReport(strategy, gamma, model=model)

    def convert_one(name: str, module: nn.Module) -> str | Left | None:
        if isinstance(module, _DropITMixin):
            module.dropit_configure(strategy, gamma)
            return type(module).__name__
        if not isinstance(module, supported):
            return None
        target = table.get(type(module))
        if target is None:
            base = next(cls for cls in supported if isinstance(module, cls))
            return Left(
                f"{type(module).__name__} is a subclass of {base.__name__} "
                "(only exact classes are converted)"
            )
        module.__class__ = target
        module.dropit_configure(strategy, gamma)
        return target.__name__

    excluded: set[str] = set()

    def make_plain(name: str, module: nn.Module) -> None:
        if isinstance(module, _DropITMixin):
            _make_plain(module)
            excluded.add(name)

    done = walk(
        model,
        [convert_one],
        exclude=lambda name, module: _own_skip_reason(name, module, patterns),
        inside=lambda outer, why: (
            f"inside skipped (root): {why}" if outer == "" else f"inside skipped {outer!r}: {why}"
        ),
        on_excluded=make_plain,
    )
    report.converted.extend(done.converted)
    modules = dict(model.named_modules())
    for name, why in done.left.items():
        if name in excluded:
            report.skipped[name] = f"{why} (made plain again)"
        elif isinstance(modules[name], supported):
            report.skipped[name] = why
    if example_inputs is None:
        if revert_unreal:
            raise ValueError("revert_unreal=True needs example_inputs to measure the saving")
        return report
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    report.saving = measure_saving(model, *args)
    if revert_unreal and report.saving.not_real:
        modules = dict(model.named_modules())
        for name in report.saving.not_real:
            layer = report.saving.layers[name]
            _make_plain(modules[name])
            report.converted.remove(name)
            report.skipped[name] = f"measured saving {layer.saving} bytes is not real: {layer.note}"
        has_dropit = any(isinstance(m, _DropITMixin) for m in modules.values())
        report.saving = measure_saving(model, *args) if has_dropit else None
    return report


def remove_dropit(model: nn.Module) -> list[str]:
    """Make every DropIT layer of ``model`` plain again (in place); returns their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, _DropITMixin):
            _make_plain(module)
            names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# Measuring the real saving
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayerSaving:
    """Measured effect of DropIT on one layer.

    Attributes:
        name: the layer's dotted name.
        input_bytes: bytes of the inputs the layer received (all calls).
        kept_bytes: bytes the DropIT layer holds for backward (values, positions, casts).
        saving: retained bytes with this layer's group plain minus with all layers DropIT;
            shared by the layers of a group.
        group: the layers measured together because they read the same input storage.
        calls: how many times the layer ran in the example forward.
        real: ``saving > 0``.
        note: why a saving is not real, or a caveat.
    """

    name: str
    input_bytes: int
    kept_bytes: int
    saving: int
    group: tuple[str, ...]
    calls: int
    real: bool
    note: str = ""


@dataclasses.dataclass
class SavingReport:
    """Bytes held for backward with and without DropIT (from :mod:`actcore.memory`)."""

    plain_bytes: int
    dropit_bytes: int
    layers: dict[str, LayerSaving] = dataclasses.field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        """Retained bytes freed by DropIT over the whole model (may be negative)."""
        return self.plain_bytes - self.dropit_bytes

    @property
    def not_real(self) -> list[str]:
        """Layers that ran and whose measured saving is not positive."""
        return [name for name, layer in self.layers.items() if layer.calls and not layer.real]

    @property
    def not_called(self) -> list[str]:
        """DropIT layers the example forward did not run (nothing measured)."""
        return [name for name, layer in self.layers.items() if not layer.calls]

    def __str__(self) -> str:
        from actcore.memory import format_bytes

        lines = [
            f"held for backward: plain {format_bytes(self.plain_bytes)}, DropIT "
            f"{format_bytes(self.dropit_bytes)}, saved {format_bytes(self.saved_bytes)}"
        ]
        for layer in self.layers.values():
            flag = "" if layer.real else "  NOT REAL" if layer.calls else "  NOT CALLED"
            lines.append(
                f"  {layer.name}: input {format_bytes(layer.input_bytes)}, kept "
                f"{format_bytes(layer.kept_bytes)}, saving {format_bytes(layer.saving)}{flag}"
                + (f" ({layer.note})" if layer.note else "")
            )
        return "\n".join(lines)


def _storage_key(t: Tensor) -> tuple[Any, ...]:
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr() or id(storage))


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


@contextlib.contextmanager
def _active_only(layers: dict[str, nn.Module], active: set[str]) -> Iterator[None]:
    """Turn DropIT off in the layers not in ``active`` (restored on exit)."""
    try:
        for name, layer in layers.items():
            layer._dropit_active = name in active
        yield
    finally:
        for layer in layers.values():
            layer.__dict__.pop("_dropit_active", None)


@contextlib.contextmanager
def _state_preserved(model: nn.Module) -> Iterator[None]:
    """Restore buffers (BatchNorm statistics) and RNG state after comparison runs."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)


def _union_groups(uses: dict[str, list[tuple[Any, int]]]) -> list[tuple[str, ...]]:
    """Connected components of layers linked by a shared input storage."""
    parent = {name: name for name in uses}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    first: dict[Any, str] = {}
    for name, inputs in uses.items():
        for key, _ in inputs:
            other = first.setdefault(key, name)
            parent[find(name)] = find(other)
    groups: dict[str, list[str]] = {}
    for name in uses:
        groups.setdefault(find(name), []).append(name)
    return [tuple(group) for group in groups.values()]


def measure_saving(model: nn.Module, *args: Any, **kwargs: Any) -> SavingReport:
    """Measure the bytes DropIT really frees on one forward of ``model(*args, **kwargs)``.

    Runs the forward (grad enabled, in the model's current train/eval mode) once to see which
    input storage each layer reads, then under :func:`actcore.memory.track`: once with every
    DropIT layer on, once with all off, and once per group of layers sharing an input storage
    with that group off. A group's saving is the difference of retained bytes, so an input that
    another node keeps anyway (a ReLU's output, which the ReLU saves for its backward, in-place
    or not) shows a negative saving: the layer is then flagged (``real=False``). Buffers and RNG
    state are restored afterwards.
    """
    from actcore import memory

    layers = {name: m for name, m in model.named_modules() if isinstance(m, _DropITMixin)}
    if not layers:
        raise ValueError("the model has no DropIT layers; convert it with to_dropit() first")
    model_inputs = {_storage_key(t) for t in _tensors_in((args, kwargs))}
    uses: dict[str, list[tuple[Any, int]]] = {name: [] for name in layers}

    def retained(active: set[str]) -> memory.MemoryReport:
        with _active_only(layers, active), torch.enable_grad():
            out, rep = memory.measure(model, *args, **kwargs)
        del out
        return rep

    with _state_preserved(model):
        # which input storage each layer reads; the inputs are held until the run ends, so a
        # freed input's address cannot come back as another layer's input
        held: list[Tensor] = []

        def record(name: str, inputs: tuple[Any, ...]) -> None:
            if inputs and isinstance(inputs[0], Tensor):
                x = inputs[0]
                held.append(x)
                uses[name].append((_storage_key(x), x.numel() * x.element_size()))

        handles = [
            layer.register_forward_pre_hook(lambda _m, i, n=name: record(n, i))
            for name, layer in layers.items()
        ]
        try:
            with torch.enable_grad():
                model(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            held.clear()
        full = retained(set(layers))
        plain = retained(set())
        result = SavingReport(plain.retained_bytes, full.retained_bytes)
        for group in _union_groups(uses):
            rest = retained(set(layers) - set(group))
            saving = rest.retained_bytes - full.retained_bytes
            for name in group:
                input_bytes = sum(nbytes for _, nbytes in uses[name])
                note = ""
                if saving <= 0:
                    note = (
                        "its input stays held for backward by another node (e.g. a ReLU's "
                        "output, in-place or not); DropIT frees nothing here"
                    )
                elif any(key in model_inputs for key, _ in uses[name]):
                    note = "input is a model input: real only if the caller frees it"
                if not uses[name]:
                    note = "not called in the example run"
                result.layers[name] = LayerSaving(
                    name=name,
                    input_bytes=input_bytes,
                    kept_bytes=full.by_module.get(name, 0),
                    saving=saving,
                    group=group,
                    calls=len(uses[name]),
                    real=saving > 0,
                    note=note,
                )
    result.layers = {name: result.layers[name] for name in layers}
    return result
