"""Models the benchmarks run: torchvision classifiers by name (random weights) and built-ins.

``build_model(name)`` returns ``(model, input_shape, num_classes)``, ``input_shape`` being
the shape of one sample; nothing is ever downloaded (torchvision models get ``weights=None``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "BUILTINS",
    "Built",
    "BuiltinModel",
    "build_model",
    "check_model",
    "default_image_size",
    "digits_cnn",
    "logits",
    "mnist1d_cnn",
    "model_names",
    "torchvision_models",
]


@dataclass(frozen=True)
class BuiltinModel:
    """A small model that ships with actcore (no torchvision needed)."""

    build: Callable[[int], nn.Module]  # num_classes -> model
    channels: int
    image_size: int
    summary: str


def _tiny_cnn(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def digits_cnn(num_classes: int = 10) -> nn.Module:
    """The small CNN of the digits accuracy benchmark (1x8x8 inputs)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def mnist1d_cnn(num_classes: int = 10) -> nn.Module:
    """The 1-D CNN of ``bench train --task mnist1d`` (1x40 inputs): three Conv1d /
    BatchNorm1d / ReLU blocks (widths 32, 64, 64; the last two halve the length), then a
    linear classifier over the flattened 64x10 features."""
    return nn.Sequential(
        nn.Conv1d(1, 32, 5, padding=2, bias=False),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Conv1d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Conv1d(64, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 10, num_classes),
    )


BUILTINS: dict[str, BuiltinModel] = {
    "tiny-cnn": BuiltinModel(_tiny_cnn, 3, 32, "2 conv + BN + ReLU blocks, 3x32x32 inputs"),
    "digits-cnn": BuiltinModel(digits_cnn, 1, 8, "the digits benchmark's CNN, 1x8x8 inputs"),
}


def torchvision_models() -> list[str]:
    """Names of torchvision's classification models ([] without torchvision)."""
    try:
        import torchvision
    except ImportError:
        return []
    return sorted(torchvision.models.list_models(module=torchvision.models))


def model_names() -> list[str]:
    """Every name :func:`build_model` takes: built-ins first, then torchvision's."""
    return [*BUILTINS, *torchvision_models()]


def check_model(name: str) -> str:
    """``name`` if it is a known model, else ValueError listing the choices."""
    if name in BUILTINS:
        return name
    tv = torchvision_models()
    if name in tv:
        return name
    close = difflib.get_close_matches(name, [*BUILTINS, *tv], n=3)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    extra = (
        f"; torchvision models: {', '.join(tv)}"
        if tv
        else " (install torchvision, e.g. the 'bench' extra, for resnet50 and the others)"
    )
    raise ValueError(f"unknown model {name!r}{hint}; built-in models: {', '.join(BUILTINS)}{extra}")


def default_image_size(name: str) -> int:
    """The input size a model is usually run at (built-ins: their own; torchvision: 224)."""
    if name in BUILTINS:
        return BUILTINS[name].image_size
    return 299 if name == "inception_v3" else 224


class Built(NamedTuple):
    """A model built by :func:`build_model`, with the shape of one input sample."""

    model: nn.Module
    input_shape: tuple[int, ...]
    num_classes: int


def build_model(name: str, num_classes: int | None = None, image_size: int | None = None) -> Built:
    """``name`` with random weights, in train mode, and its per-sample input shape.

    ``num_classes`` defaults to 10 for built-ins and 1000 for torchvision models.
    """
    check_model(name)
    size = image_size or default_image_size(name)
    if name in BUILTINS:
        spec = BUILTINS[name]
        classes = num_classes or 10
        return Built(spec.build(classes).train(), (spec.channels, size, size), classes)
    import torchvision

    classes = num_classes or 1000
    model = torchvision.models.get_model(name, weights=None, num_classes=classes)
    return Built(model.train(), (3, size, size), classes)


def logits(output: object) -> torch.Tensor:
    """The logits of a model's output (inception/googlenet return a tuple in train mode)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    main = getattr(output, "logits", None)
    if isinstance(main, torch.Tensor):
        return main
    raise TypeError(f"cannot find the logits in a model output of type {type(output).__name__}")
