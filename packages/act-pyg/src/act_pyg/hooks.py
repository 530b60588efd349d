"""The saved-tensor hooks route for message-passing layers without a converted version.

If actcore provides ``actcore.compress_saved_tensors`` it is used (at the bits of the
layer-swap level); for an actcore without it, a small local
pair of ``torch.autograd.graph.saved_tensors_hooks`` quantizes floating tensors that are
saved for backward (at the level's conv bits), passes integers, bools, parameters and small
tensors through, packs a tensor saved twice once, and reports what it keeps to
:func:`actcore.memory.note_saved` so memory tracking sees it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

import actcore
from actcore import memory, ops
from actcore.config import config, level_spec

HOOKS_ATTR = "_act_pyg_hooks"


def core_hooks_available() -> bool:
    """Whether actcore's own saved-tensor hooks route exists."""
    return hasattr(actcore, "compress_saved_tensors")


class QuantizingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Quantize floating tensors saved for backward to ``bits`` bits (local fallback)."""

    def __init__(self, bits: int, group_size: int | None = None) -> None:
        self.bits = ops.api.check_bits(bits)
        self.group_size = group_size or config.group_size
        self._seen: dict[tuple[int, int], tuple[Tensor, Any]] = {}
        super().__init__(self._pack, self._unpack)

    def _skip(self, t: Tensor) -> bool:
        return (
            not t.is_floating_point()
            or t.numel() < config.min_numel
            or isinstance(t, nn.Parameter)
            or isinstance(t._base, nn.Parameter)
            or (t.requires_grad and t.is_leaf)
        )

    def _pack(self, t: Tensor) -> Any:
        if self._skip(t):
            memory.note_saved(t)
            return t
        key = (id(t), t._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0] is t:
            return seen[1]
        per_sample = t.dim() >= 2 and t[0].numel() >= self.group_size
        packed = ops.quantize(t, self.bits, group_size=self.group_size, per_sample=per_sample)
        self._seen[key] = (t, packed)  # held until the context exits (the layer's forward)
        memory.note_saved(packed)
        return packed

    @staticmethod
    def _unpack(obj: Any) -> Tensor:
        return ops.dequantize(obj) if isinstance(obj, ops.Packed) else obj

    def __exit__(self, *exc: object) -> None:
        self._seen.clear()
        super().__exit__(*exc)


def saved_tensor_context(level: str | None) -> contextlib.AbstractContextManager:
    """A context that compresses what autograd saves inside it, at ``level``."""
    spec = level_spec(level if level is not None else config.level)
    if spec.conv_bits is None:
        return contextlib.nullcontext()
    if core_hooks_available():  # the layer-swap level's bits (hook levels have other names)
        return actcore.compress_saved_tensors(spec.conv_bits, group_size=config.group_size)
    return QuantizingHooks(spec.conv_bits)


def _pre(module: nn.Module, args: Any) -> None:
    ctx = saved_tensor_context(getattr(module, "act_level", None))
    ctx.__enter__()
    module.__dict__.setdefault("_act_pyg_stack", []).append(ctx)


def _post(module: nn.Module, args: Any, output: Any) -> None:
    stack = module.__dict__.get("_act_pyg_stack")
    if stack:
        stack.pop().__exit__(None, None, None)


def install(module: nn.Module, level: str) -> None:
    """Run ``module``'s forward under the saved-tensor hooks route at ``level`` (idempotent)."""
    module.act_level = level
    if getattr(module, HOOKS_ATTR, None):
        return
    handles = (
        module.register_forward_pre_hook(_pre),
        module.register_forward_hook(_post, always_call=True),
    )
    setattr(module, HOOKS_ATTR, handles)


def uninstall(module: nn.Module) -> None:
    """Undo :func:`install`."""
    for handle in getattr(module, HOOKS_ATTR, None) or ():
        handle.remove()
    with contextlib.suppress(AttributeError):
        delattr(module, HOOKS_ATTR)


def route_name() -> str:
    """Which implementation of the hooks route is in use."""
    return "actcore.compress_saved_tensors" if core_hooks_available() else "act_pyg local hooks"
