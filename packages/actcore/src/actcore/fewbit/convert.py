"""Model surgery: ``map_module`` (rebuild a module tree) and ``convert_linear``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["convert_linear", "map_module"]


def map_module(root: nn.Module, fn: Callable[[nn.Module, str], nn.Module]) -> nn.Module:
    """Replace every module of the tree by ``fn(module, path)``, in place; return the root.

    ``path`` is the dotted name as in ``named_modules()`` (``""`` for the root). Children are
    mapped before their parent (post-order), and the replacements ``fn`` returns are not
    walked again. A module reached by several paths is mapped once (at its first path) and
    its replacement put at every place. The returned root is ``fn(root, "")``: keep it.
    """
    if not isinstance(root, nn.Module):
        raise TypeError(f"map_module takes an nn.Module, got {type(root).__name__}")
    done: dict[int, nn.Module] = {}

    def visit(module: nn.Module, path: str) -> nn.Module:
        if id(module) in done:
            return done[id(module)]
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            new = visit(child, f"{path}.{name}" if path else name)
            if new is not child:
                setattr(module, name, new)
        out = fn(module, path)
        if not isinstance(out, nn.Module):
            raise TypeError(
                f"map_module's fn must return an nn.Module, got {type(out).__name__} "
                f"for {path or '<root>'!r}"
            )
        done[id(module)] = out
        return out

    return visit(root, "")


def _accepts(ctor: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(ctor).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _convert_one(linear: nn.Linear, ctor: Callable[..., nn.Module], kw: dict) -> nn.Module:
    weight, bias = linear.weight, linear.bias
    extra = dict(kw)
    if _accepts(ctor, "device") and _accepts(ctor, "dtype"):
        extra.update(device=weight.device, dtype=weight.dtype)
    new = ctor(linear.in_features, linear.out_features, bias=bias is not None, **extra)
    if getattr(new, "weight", None) is None or new.weight.shape != weight.shape:
        raise TypeError(f"{ctor!r} did not build a weight of shape {tuple(weight.shape)}")
    new.weight = weight  # the same Parameter objects: optimizers built before stay valid
    if bias is not None:
        new.bias = bias
    new.train(linear.training)
    return new


def convert_linear(module: nn.Module, ctor: Callable[..., nn.Module], **kw: Any) -> nn.Module:
    """Replace every plain ``nn.Linear`` in ``module`` (itself included) by
    ``ctor(in_features, out_features, bias=..., **kw)``; return the (possibly new) module.

    The new layers take over the old ``weight`` and ``bias`` Parameters, so ``state_dict``
    keys, values, devices and dtypes stay the same. Subclasses of ``nn.Linear`` (already
    converted layers, ``NonDynamicallyQuantizableLinear``, ...) are left alone. It works
    on a whole model, or as ``map_module``'s ``fn`` on single modules.
    """

    def fn(m: nn.Module, _path: str) -> nn.Module:
        return _convert_one(m, ctor, kw) if type(m) is nn.Linear else m

    return map_module(module, fn)
