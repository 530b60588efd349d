"""``to_dropit`` and ``remove_dropit``: swapping a model's layers for DropIT's and back."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Iterable
from typing import Any

from torch import nn

from actcore.walker import Left, walk

from .mink import check_gamma, check_strategy
from .modules import DropITMixin, conversions, make_plain
from .saving import SavingReport, measure_saving

__all__ = [
    "DropITReport",
    "remove_dropit",
    "to_dropit",
]


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
    strategy = check_strategy(strategy)
    gamma = check_gamma(gamma)
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_dropit takes an nn.Module, got {type(model).__name__}")
    patterns = _skip_patterns(skip)
    if not inplace:
        model = copy.deepcopy(model)
    table = conversions()
    supported = tuple(table)
    report = DropITReport(strategy, gamma, model=model)

    def convert_one(name: str, module: nn.Module) -> str | Left | None:
        if isinstance(module, DropITMixin):
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

    def plain_again(name: str, module: nn.Module) -> None:
        if isinstance(module, DropITMixin):
            make_plain(module)
            excluded.add(name)

    done = walk(
        model,
        [convert_one],
        exclude=lambda name, module: _own_skip_reason(name, module, patterns),
        inside=lambda outer, why: (
            f"inside skipped (root): {why}" if outer == "" else f"inside skipped {outer!r}: {why}"
        ),
        on_excluded=plain_again,
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
            make_plain(modules[name])
            report.converted.remove(name)
            report.skipped[name] = f"measured saving {layer.saving} bytes is not real: {layer.note}"
        has_dropit = any(isinstance(m, DropITMixin) for m in modules.values())
        report.saving = measure_saving(model, *args) if has_dropit else None
    return report


def remove_dropit(model: nn.Module) -> list[str]:
    """Make every DropIT layer of ``model`` plain again (in place); returns their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, DropITMixin):
            make_plain(module)
            names.append(name)
    return names
