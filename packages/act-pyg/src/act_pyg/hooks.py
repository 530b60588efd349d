"""The saved-tensor hooks route for message-passing layers without a converted version.

:func:`install` runs a layer's forward under :func:`actcore.compress_saved_tensors` at the
bits of its layer-swap level: floating tensors autograd saves are quantized; integers,
bools, parameters and small tensors pass through; what ops that compare saved values
save (PyG's max/min aggregation is a ``scatter_reduce(reduce="amax")``) stays exact.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

import actcore
from actcore.config import config, level_spec

HOOKS_ATTR = "_act_pyg_hooks"


def saved_tensor_context(level: str | None) -> contextlib.AbstractContextManager:
    """A context that compresses what autograd saves inside it, at ``level``."""
    spec = level_spec(level if level is not None else config.level)
    if spec.conv_bits is None:
        return contextlib.nullcontext()
    # the layer-swap level's bits (the hook levels have other names)
    return actcore.compress_saved_tensors(spec.conv_bits, group_size=config.group_size)


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
