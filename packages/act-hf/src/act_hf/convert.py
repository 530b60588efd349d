"""``act_hf.convert``: compress the activations a Hugging Face model keeps for backward."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

import actcore
from actcore.config import LevelSpec, level_spec
from actcore.convert import check_exclude as _check_exclude
from actcore.convert import is_excluded as _excluded
from actcore.fewbit.tables import check_bits
from actcore.layers import QLayer

from .attention import ATTENTION_NAME, register_attention
from .layers import FEWBIT_ACTIVATIONS, QConv1D, is_fewbit

log = logging.getLogger("act_hf")

__all__ = ["HFConversionReport", "convert", "default_fewbit_bits"]

Exclude = str | type | Callable[[str, nn.Module], bool]

# Leaf modules that keep nothing worth compressing for backward (an embedding keeps its
# integer indices; the others keep nothing at all).
_NOTHING_SAVED: tuple[type[nn.Module], ...] = (nn.Embedding, nn.Identity, nn.Flatten)
_NOTHING_SAVED_NAMES = {"LinearActivation", "Identity"}


@dataclass
class HFConversionReport(actcore.ConversionReport):
    """:class:`actcore.ConversionReport` plus the attention implementation in use.

    ``converted``: module name -> class it now has; ``left``: module name -> why it was left
    (excluded, no compressed counterpart, ...); ``attention``: the model's attention
    implementation after conversion; ``fewbit_bits``: bits of activation derivatives
    (None: activations were left as they are).
    """

    attention: str | None = None
    fewbit_bits: int | None = None

    def __str__(self) -> str:
        lines = [
            f"act_hf.convert at {self.level}: {len(self.converted)} modules converted, "
            f"attention={self.attention!r}, fewbit_bits={self.fewbit_bits}"
        ]
        lines += [f"  left {name or '<root>'}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


def default_fewbit_bits(spec: LevelSpec) -> int | None:
    """Derivative bits of continuous activations (GELU, SiLU, tanh, ...) at a level.

    None (activations keep their input in full precision) at levels that keep linear
    inputs in full precision (L0, swap); 4 at 4-bit levels (L1, L2); 3 at 2-bit levels
    (L3 and up): FewBit's default, whose optimal 3-bit GELU derivative trains as the exact
    one does in its authors' experiments, at 3/32 of float32's memory.
    """
    if spec.conv_bits is None:
        return None
    return 4 if spec.conv_bits >= 4 else 3


def _set_attention(model: nn.Module, report: HFConversionReport) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        report.left["<attention>"] = "the model has no config._attn_implementation"
        return
    report.attention = config._attn_implementation  # unchanged unless set below
    if not register_attention():
        report.left["<attention>"] = "this transformers has no AttentionInterface"
        return
    if getattr(config, "reorder_and_upcast_attn", False):
        report.left["<attention>"] = "reorder_and_upcast_attn=True computes its own attention"
        return
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        report.left["<attention>"] = (
            f"{type(model).__name__} does not dispatch attention through AttentionInterface"
        )
        return
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTENTION_NAME)
    else:  # transformers 4.x before set_attn_implementation
        for module in model.modules():
            sub = getattr(module, "config", None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                sub._attn_implementation = ATTENTION_NAME
    report.attention = config._attn_implementation


def convert(
    model: nn.Module,
    level: str = "L3",
    *,
    attention: bool = True,
    fewbit_bits: int | None = None,
    exclude: Iterable[Exclude] = (),
) -> nn.Module:
    """Compress what ``model`` (any ``PreTrainedModel``, or any module) keeps for backward.

    In place, by module type (never by name): ``nn.Linear``, transformers' ``Conv1D``, norm,
    convolution, pooling, ReLU-family and ``nn.Dropout`` modules become actcore Q-layers
    (``actcore.convert``; dropout keeps a 1-bit mask); continuous activations (the ``ACT2FN``
    classes such as ``GELUActivation``, ``NewGELUActivation``, and torch's ``nn.GELU``,
    ``nn.SiLU``, ``nn.Tanh``...) keep a ``fewbit_bits``-bit derivative (default:
    :func:`default_fewbit_bits` of the level); with ``attention`` the model's attention
    implementation becomes ``act_eager`` (see :mod:`act_hf.attention`).

    Parameters, buffers, ``state_dict`` keys and forward outputs stay the same. ``exclude``
    takes module names (fnmatch patterns), types or predicates ``(name, module) -> bool``.
    Idempotent: converting again applies the new settings. The :class:`HFConversionReport`
    is ``model.act_report``. Unknown level: ValueError; bits outside 1..4: ValueError.
    """
    spec = level_spec(level)
    if fewbit_bits is not None:
        fewbit_bits = check_bits(fewbit_bits)
    bits = fewbit_bits if fewbit_bits is not None else default_fewbit_bits(spec)
    rules = _check_exclude(exclude)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actcore.convert(model, spec.name, exclude=rules, fewbit_bits=bits)
    core = model.act_report
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    report = HFConversionReport(spec.name, dict(core.converted), dict(core.left), fewbit_bits=bits)
    for name, module in model.named_modules():
        if name in report.converted or name in report.left:
            continue
        if isinstance(module, (QConv1D, Conv1D)):
            if _excluded(name, module, rules):
                report.left[name] = "excluded"
                continue
            module.__class__ = QConv1D
            module.act_level = spec.name
            report.converted[name] = "QConv1D"
        elif is_fewbit(module) or type(module) in FEWBIT_ACTIVATIONS:
            if _excluded(name, module, rules):
                report.left[name] = "excluded"
            elif bits is None:
                report.left[name] = f"{spec.name} keeps activation inputs as they are"
            else:
                if not is_fewbit(module):
                    module.__class__ = FEWBIT_ACTIVATIONS[type(module)]
                module.bits = bits
                report.converted[name] = type(module).__name__
        elif not any(True for _ in module.children()) and not _saves_nothing(module):
            report.left[name] = f"no compressed counterpart for {type(module).__name__}"
    if attention:
        for module in model.modules():
            if hasattr(module, "config") and not isinstance(module, QLayer):
                module.act_attention_level = spec.name
        _set_attention(model, report)
    else:
        report.attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    model.act_report = report
    log.info("%s", report)
    return model


def _saves_nothing(module: nn.Module) -> bool:
    return isinstance(module, _NOTHING_SAVED) or type(module).__name__ in _NOTHING_SAVED_NAMES
