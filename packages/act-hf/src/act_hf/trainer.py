"""``ACTCallback``: convert the model a ``transformers.Trainer`` trains, when training begins."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from actcore.extend import LevelSpec, level_spec

from .convert import convert

__all__ = ["ACTCallback"]


class ACTCallback(TrainerCallback):
    """``Trainer(..., callbacks=[ACTCallback("L3")])`` converts the model at train begin.

    The conversion swaps classes in place, so the optimizer the Trainer already built keeps
    its parameters. Keyword arguments go to :func:`act_hf.convert`. Equivalent to calling
    ``act_hf.convert(model, ...)`` before building the Trainer.
    """

    def __init__(self, level: str | LevelSpec = "L3", **convert_kwargs: Any) -> None:
        self.spec = level_spec(level)  # ValueError now if unknown
        self.convert_kwargs = convert_kwargs
        self.report = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ACTCallback: the Trainer passed no model to on_train_begin")
        convert(model, self.spec, **self.convert_kwargs)
        self.report = model.act_report
        return control
