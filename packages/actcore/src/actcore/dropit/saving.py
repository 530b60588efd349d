"""Measuring the bytes DropIT really frees, per layer, with :mod:`actcore.memory`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .modules import DropITMixin

__all__ = [
    "LayerSaving",
    "SavingReport",
    "measure_saving",
]


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
    from actcore.memory.storage import storage_of

    layers = {name: m for name, m in model.named_modules() if isinstance(m, DropITMixin)}
    if not layers:
        raise ValueError("the model has no DropIT layers; convert it with to_dropit() first")
    model_inputs = {storage_of(t)[0] for t in _tensors_in((args, kwargs))}
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
                uses[name].append((storage_of(x)[0], x.numel() * x.element_size()))

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
