"""``convert``: swap a model's standard layers for Q-layers, in place, keeping everything.

The swap changes each module's class to its Q-layer subclass: the module object, its
parameters (and so optimizer state), buffers, hooks and ``state_dict`` keys stay the same.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from .config import config, level_spec
from .layers.modules import Q_LAYERS, QLayer, unsupported_reason

log = logging.getLogger("actcore")

Exclude = str | type | Callable[[str, nn.Module], bool]


@dataclass
class ConversionReport:
    """What :func:`convert` did: converted module names, and those left with the reason."""

    level: str
    converted: dict[str, str] = field(default_factory=dict)  # name -> Q-layer class
    left: dict[str, str] = field(default_factory=dict)  # name -> reason

    def __str__(self) -> str:
        lines = [f"actcore.convert at {self.level}: {len(self.converted)} converted"]
        lines += [f"  left {name or '<root>'}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


def _excluded(name: str, module: nn.Module, exclude: Iterable[Exclude]) -> bool:
    for rule in exclude:
        if isinstance(rule, str) and (fnmatch.fnmatchcase(name, rule) or name == rule):
            return True
        if isinstance(rule, type) and isinstance(module, rule):
            return True
        if callable(rule) and not isinstance(rule, type) and rule(name, module):
            return True
    return False


def convert(
    model: nn.Module,
    level: str | None = None,
    *,
    exclude: Iterable[Exclude] = (),
    inplace: bool = True,
) -> nn.Module:
    """Swap ``model``'s standard layers for Q-layers at ``level`` (default: ``config.level``).

    ``exclude`` takes module names (fnmatch patterns), module types, or predicates
    ``(name, module) -> bool``. Idempotent; converting again sets the new level. A layer
    whose configuration a Q-layer cannot take is left as it is, with a warning. The
    :class:`ConversionReport` is returned model's ``act_report`` attribute (and logged).
    """
    spec = level_spec(level if level is not None else config.level)
    if spec.expandable_segments:
        from .allocator import enable_expandable_segments

        enable_expandable_segments()
    exclude = tuple(exclude)
    if not inplace:
        model = copy.deepcopy(model)
    report = ConversionReport(spec.name)
    for name, module in model.named_modules():
        if isinstance(module, QLayer):
            module.act_level = spec.name
            report.converted[name] = type(module).__name__
            continue
        target = Q_LAYERS.get(type(module))
        if target is None:
            if any(isinstance(module, base) for base in Q_LAYERS):
                report.left[name] = f"a subclass of {_base_name(module)} with its own behaviour"
            continue
        if _excluded(name, module, exclude):
            report.left[name] = "excluded"
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            report.left[name] = reason
            warnings.warn(
                f"actcore.convert left {name or '<root>'} unconverted: {reason}", stacklevel=2
            )
            continue
        module.__class__ = target
        module.act_level = spec.name
        report.converted[name] = target.__name__
    _set_adaptive(model, spec.adaptive)
    model.act_report = report
    log.info("%s", report)
    return model


def _set_adaptive(model: nn.Module, adaptive: bool) -> None:
    """Attach (or keep) one :class:`AdaptiveBits` at adaptive levels, else detach it."""
    from .adaptive import AdaptiveBits

    scheme = getattr(model, "act_adaptive", None)
    if adaptive:
        if not isinstance(scheme, AdaptiveBits):
            scheme = AdaptiveBits()
        model.act_adaptive = scheme.attach(model)
    elif scheme is not None:
        AdaptiveBits.detach(model)
        model.act_adaptive = None


def _base_name(module: nn.Module) -> str:
    return next(base.__name__ for base in Q_LAYERS if isinstance(module, base))


def QModule(model: nn.Module) -> nn.Module:
    """ActNN's entry point: ``convert(model)`` at the level set by ``set_optimization_level``."""
    return convert(model)
