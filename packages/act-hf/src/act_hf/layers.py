"""Compressed counterparts of transformers' own layers: GPT-2's ``Conv1D`` and the activation
modules of ``transformers.activations`` (the ``ACT2FN`` classes).

Like actcore's Q-layers they are subclasses of the original class, installed by changing
``module.__class__`` in place: same object, parameters and ``state_dict`` keys, and
``isinstance`` still holds. The forward output is the original forward's, bitwise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import activations as hf_activations
from transformers.pytorch_utils import Conv1D

from actcore.extend import (
    CONV,
    IDENTITY,
    QLayer,
    TableCode,
    apply_code,
    call_outside_modes,
    get_table,
    guard_input,
    own_output,
    register_activation,
    register_q_layer,
    register_recomputed,
    stash,
    unstash,
)

__all__ = ["FEWBIT_ACTIVATIONS", "Conv1DFunction", "QConv1D", "fewbit_class_for"]


class Conv1DFunction(torch.autograd.Function):
    """GPT-2's ``Conv1D`` (``addmm`` with a transposed weight), input saved compressed."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        size_out = (*x.size()[:-1], weight.shape[1])
        out = own_output(torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(size_out))
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        stash(ctx, layer, [(x if weight.requires_grad else None, CONV), (weight, IDENTITY)])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = unstash(ctx)
        x = guard_input(ctx, x, weight, grad)  # a 2nd derivative through it: a clear error
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if need_x:  # under autocast grad may be half while the weight is float32
            gx = g2.mm(weight.t().to(g2.dtype)).view(*grad.shape[:-1], -1).to(x_dtype)
        if need_w:
            gw = x.reshape(-1, x.shape[-1]).to(g2.dtype).t().mm(g2).to(w_dtype)
        if need_b:
            gb = g2.sum(0).to(b_dtype)
        return gx, gw, gb, None


class QConv1D(QLayer, Conv1D):
    """transformers' ``Conv1D`` keeping its input at the level's conv/linear bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._compresses(x, self.weight, self.bias):
            return super().forward(x)
        return Conv1DFunction.apply(x, self.weight, self.bias, self)

    def __repr__(self) -> str:
        level = "" if self.act_level is None else f", act_level={self.act_level!r}"
        return f"QConv1D(nf={self.nf}, nx={self.nx}{level})"


@functools.cache
def _table_code(name: str, bits: int, params: tuple[tuple[str, Any], ...]) -> TableCode:
    return TableCode(get_table(name, bits, **dict(params)))


class _FewBitHF:
    """Mixin: the original activation's forward, its derivative kept at ``bits`` bits."""

    bits: int = 3
    fewbit_name: str = ""
    fewbit_params: tuple[tuple[str, Any], ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # its own tailored treatment: a converted model's functional-op router stays out
        return call_outside_modes(super().__call__, args, kwargs)  # type: ignore[misc]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        base = super().forward  # type: ignore[misc]
        return apply_code(
            input, base, lambda: _table_code(self.fewbit_name, self.bits, self.fewbit_params)
        )

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, bits={self.bits}" if base else f"bits={self.bits}"


_TANH = (("approximate", "tanh"),)
_EXACT = (("approximate", "none"),)
# transformers class name -> (FewBit table, its parameters). Names missing from the
# installed transformers are skipped (GELUTanh is 5.x; PytorchGELUTanh its 4.x name).
_HF_TABLES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "GELUActivation": ("gelu", _EXACT),
    "NewGELUActivation": ("gelu", _TANH),
    "GELUTanh": ("gelu", _TANH),
    "PytorchGELUTanh": ("gelu", _TANH),
    "FastGELUActivation": ("gelu", _TANH),
    "AccurateGELUActivation": ("gelu", _TANH),
    "SiLUActivation": ("silu", ()),
    "MishActivation": ("mish", ()),
}

FEWBIT_ACTIVATIONS: dict[type[nn.Module], type[nn.Module]] = {}
"""transformers' activation class -> its few-bit subclass (torch's own activations are
actcore.convert's: ``actcore.convert(..., fewbit_bits=...)`` swaps them first)."""

for _name, (_table, _params) in _HF_TABLES.items():
    _base = getattr(hf_activations, _name, None)
    if not isinstance(_base, type) or _base in FEWBIT_ACTIVATIONS:
        continue
    _qname = f"FewBit{_name}"
    _cls = type(
        _qname,
        (_FewBitHF, _base),
        {
            "__module__": __name__,
            "__qualname__": _qname,
            "__doc__": f"``{_name}`` with a few-bit ({_table}) derivative.",
            "fewbit_name": _table,
            "fewbit_params": _params,
        },
    )
    globals()[_qname] = _cls  # importable by name, so pickling works
    FEWBIT_ACTIVATIONS[_base] = _cls
    register_activation(_base, _cls, smooth=True)  # actcore.convert swaps it

register_q_layer(Conv1D, QConv1D)

# Without few-bit codes, transformers' activations keep their input and are recomputed in
# backward (their output, saved by the next linear, derives from it): the composite ones
# (NewGELU's tanh formula, QuickGELU's sigmoid product...) would otherwise keep each step.
RECOMPUTED_ACTIVATIONS = (
    "GELUActivation",
    "ClippedGELUActivation",
    "FastGELUActivation",
    "NewGELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
    "AccurateGELUActivation",
    "LaplaceActivation",
    "MishActivation",
    "QuickGELUActivation",
    "ReLUSquaredActivation",
    "SiLUActivation",
    "SqrtSoftplusActivation",
)
# those whose forward is one torch op with an input-only backward op: backward calls that op
_INPUT_DERIVATIVES = {"SiLUActivation": lambda grad, x: torch.ops.aten.silu_backward(grad, x)}
for _name in RECOMPUTED_ACTIVATIONS:
    _base = getattr(hf_activations, _name, None)
    if isinstance(_base, type):
        register_recomputed(_base, _INPUT_DERIVATIVES.get(_name))


def fewbit_class_for(module: nn.Module) -> type[nn.Module] | None:
    """The few-bit class that ``module`` (an activation, by exact type) converts to."""
    return FEWBIT_ACTIVATIONS.get(type(module))


def is_fewbit(module: nn.Module) -> bool:
    """Whether ``module`` is already one of this package's few-bit activations."""
    return type(module) in set(FEWBIT_ACTIVATIONS.values())
