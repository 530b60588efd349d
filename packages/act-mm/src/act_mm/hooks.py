"""``ACTConvertHook``: convert a runner's whole model to Q-layers from one config entry.

``custom_hooks = [dict(type='ACTConvertHook', level='L3', exclude=['*.fc'])]``

It runs :func:`actcore.convert` at ``before_run`` with the highest priority, i.e. before
weights are initialised or loaded (``load_from`` / ``resume``), before any other hook's
``before_run`` (e.g. EMA copies) and before the first iteration. mmengine builds the
optimizer and wraps the model for DDP earlier (in ``Runner.train`` / ``Runner.__init__``),
which is safe: ``convert`` changes each module's class in place, so every ``Parameter``
object, and with it the optimizer's param groups, DDP's parameter list and the
``state_dict`` keys, stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

import actcore
from actcore.extend import level_spec


@HOOKS.register_module(force=True)  # force: a reloaded act_mm replaces its own class
class ACTConvertHook(Hook):
    """Swap the runner model's standard layers for actcore Q-layers at ``level``.

    Args:
        level: an actcore optimization level (``actcore.config.LEVELS``); ``None`` uses the
            process-wide level (``actcore.set_optimization_level``).
        exclude: module names or fnmatch patterns (e.g. ``'bbox_head.*'``) to leave as
            they are; types and predicates work too when the hook is built in Python.
        log_layers: also log every converted module's name (the summary is always logged).

    Layers a config already built as Q-layers (``conv_cfg=dict(type='QConv2d')``) are
    kept and given ``level`` too. The :class:`actcore.ConversionReport` is logged and kept
    as ``model.act_report``.
    """

    priority = "VERY_HIGH"

    def __init__(
        self,
        level: str | None = "L3",
        exclude: Sequence[Any] = (),
        log_layers: bool = False,
    ) -> None:
        self.spec = None if level is None else level_spec(level)  # ValueError if unknown
        if isinstance(exclude, str):
            exclude = [exclude]
        self.exclude = tuple(exclude)
        self.log_layers = log_layers
        self.report: actcore.ConversionReport | None = None

    def before_run(self, runner: Any) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        actcore.convert(model, level=self.spec, exclude=self.exclude)
        self.report = model.act_report
        by_type: dict[str, int] = {}
        for cls_name in self.report.converted.values():
            by_type[cls_name] = by_type.get(cls_name, 0) + 1
        summary = ", ".join(f"{n} {t}" for t, n in sorted(by_type.items()))
        runner.logger.info(
            f"ACTConvertHook: {len(self.report.converted)} modules at level "
            f"{self.report.level} ({summary or 'none'})"
        )
        for name, why in self.report.left.items():
            runner.logger.info(f"ACTConvertHook: left {name or '<root>'}: {why}")
        if self.log_layers:
            for name, cls_name in self.report.converted.items():
                runner.logger.info(f"ACTConvertHook: {name or '<root>'} -> {cls_name}")
