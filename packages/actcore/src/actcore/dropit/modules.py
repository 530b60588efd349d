"""The DropIT layers: torch's Linear and Conv1d/2d/3d (and transformers' ``Conv1D``) whose
saved input is min-k sparsified, and the table of which torch class becomes which."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcore.layers.autocast import autocast_cast

from .function import ConvOp, DropITFunction, LinearOp, autocast_dtype
from .mink import check_gamma, check_strategy

__all__ = [
    "DropITConv1d",
    "DropITConv2d",
    "DropITConv3d",
    "DropITLinear",
    "DropITMixin",
    "conversions",
    "is_dropit",
    "make_plain",
]


class DropITMixin(nn.Module):
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
        self.dropit_strategy = check_strategy(strategy)
        self.dropit_gamma = check_gamma(gamma)

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
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:  # cast as autocast would, so the Function sees one dtype
            x, weight, bias = (
                autocast_cast(x, dtype),
                autocast_cast(weight, dtype),
                autocast_cast(bias, dtype),
            )
        return self._dropit_apply(x, weight, bias)

    def _dropit_run(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, op: LinearOp | ConvOp
    ) -> Tensor:
        per_sample = self.dropit_strategy == "mink_sample"
        return DropITFunction.apply(x, weight, bias, op, self.dropit_gamma, per_sample)

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropit={self.dropit_strategy}(gamma={self.dropit_gamma})"


class DropITLinear(DropITMixin, nn.Linear):
    """``nn.Linear`` whose saved input is min-k sparsified (extra kwargs ``gamma``, ``strategy``)."""

    _dropit_base = nn.Linear

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._dropit_run(x, weight, bias, LinearOp())


class _DropITConvNd(DropITMixin):
    """Conv layers: padding modes and string padding resolved as torch does, then one op."""

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        dims = weight.dim() - 2
        unbatched = x.dim() == dims + 1
        if unbatched:
            x = x.unsqueeze(0)
        x, padding = self._dropit_pad(x, dims)
        op = ConvOp(tuple(self.stride), padding, tuple(self.dilation), self.groups)
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


class _DropITHFConv1D(DropITMixin):
    """transformers' ``Conv1D`` (GPT-2): ``x @ W + b`` with the weight stored (in, out)."""

    def _dropit_apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._dropit_run(x, weight, bias, LinearOp(weight_in_out=True))


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


def conversions() -> dict[type, type]:
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


def make_plain(module: nn.Module) -> None:
    """Turn a DropIT layer back into its torch class (parameters untouched)."""
    module.__class__ = module._dropit_base
    for attr in ("dropit_gamma", "dropit_strategy", "_dropit_active"):
        module.__dict__.pop(attr, None)


def is_dropit(module: nn.Module) -> bool:
    """True for a DropIT layer."""
    return isinstance(module, DropITMixin)
