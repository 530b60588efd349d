"""``act_hf.convert``: compress the activations a Hugging Face model keeps for backward."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

import actcore
from actcore.extend import (
    FEWBIT_MAX_BITS,
    Exclude,
    LevelSpec,
    QLayer,
    check_bits,
    level_spec,
)
from actcore.extend import default_fewbit_bits as core_default_fewbit_bits

from .attention import ATTENTION_NAME, register_attention

log = logging.getLogger("act_hf")

__all__ = ["ATTENTION_CHOICES", "HFConversionReport", "convert", "default_fewbit_bits"]


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
    """Derivative bits of smooth activations at a level (:func:`actcore.convert.default_fewbit_bits`)."""
    return core_default_fewbit_bits(spec)


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


ATTENTION_CHOICES = ("keep", ATTENTION_NAME)


def _check_attention(attention: str | bool) -> str:
    if attention is True:  # the 0.1 API: True chose act_eager
        return ATTENTION_NAME
    if attention is False:
        return "keep"
    if attention not in ATTENTION_CHOICES:
        raise ValueError(
            f"attention must be one of {', '.join(map(repr, ATTENTION_CHOICES))}, got {attention!r}"
        )
    return attention


def convert(
    model: nn.Module,
    level: str | LevelSpec = "L3",
    *,
    attention: str | bool = "keep",
    fewbit_bits: int | None = None,
    exclude: Iterable[Exclude] = (),
) -> nn.Module:
    """Compress what ``model`` (any ``PreTrainedModel``, or any module) keeps for backward.

    :func:`actcore.convert` at ``level``, with transformers' own layers declared to it
    (GPT-2's ``Conv1D`` becomes :class:`QConv1D`; the ``ACT2FN`` activation classes such as
    ``GELUActivation`` get few-bit derivatives, ``fewbit_bits`` bits, default
    :func:`default_fewbit_bits` of the level): linear, ``Conv1D``, norm, convolution,
    pooling, ReLU-family and dropout modules become Q-layers, and everything else the
    forward saves (the attention call, RMSNorms, gated products, the loss when ``labels``
    are passed) is compressed by the model's scope (:mod:`actcore.layers.scope`).

    ``attention``: ``"keep"`` (default) keeps the model's configured implementation (sdpa,
    flash): the scope stores its q, k, v compressed and reruns the same kernel in backward.
    ``"act_eager"`` switches to :mod:`act_hf.attention`'s eager attention (probabilities
    kept compressed; quadratic in the sequence, opt-in).

    Parameters, buffers, ``state_dict`` keys and forward outputs stay the same. ``exclude``
    takes module names (fnmatch patterns), types or predicates ``(name, module) -> bool``.
    Idempotent: converting again applies the new settings. The :class:`HFConversionReport`
    is ``model.act_report``. Unknown level: ValueError; bits outside 1..4: ValueError.
    """
    spec = level_spec(level)
    attention = _check_attention(attention)
    if fewbit_bits is not None:
        fewbit_bits = check_bits(fewbit_bits, "fewbit_bits", high=FEWBIT_MAX_BITS)
    bits = fewbit_bits if fewbit_bits is not None else default_fewbit_bits(spec)
    actcore.convert(model, spec, exclude=exclude, fewbit_bits=bits)
    core = model.act_report
    report = HFConversionReport(
        spec.name, dict(core.converted), dict(core.left), core.scope, fewbit_bits=bits
    )
    if attention == ATTENTION_NAME:
        for module in model.modules():
            if hasattr(module, "config") and not isinstance(module, QLayer):
                module.act_attention_spec = spec
        _set_attention(model, report)
    else:
        report.attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    model.act_report = report
    log.info("%s", report)
    return model
