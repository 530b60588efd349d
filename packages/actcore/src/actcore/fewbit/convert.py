"""Model surgery: ``map_module`` (rebuild a module tree) and ``convert_linear``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "SMOOTH_LEFT",
    "convert_linear",
    "fewbit_target",
    "fewbit_target_of",
    "is_fewbit",
    "map_module",
    "register_activation",
    "swap_activation",
]


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


# --------------------------------------------------------------------------------------------
# Activation swap (used by ``actcore.convert(..., fewbit_bits=k)`` and ``Controller``)
# --------------------------------------------------------------------------------------------

SMOOTH_LEFT = (
    "smooth activation kept as it is (layers only): pass fewbit_bits=k for a few-bit derivative"
)


def _builtin_tables() -> tuple[dict[type, type], dict[type, type]]:
    from . import modules as M

    smooth = {
        nn.CELU: M.CELU,
        nn.ELU: M.ELU,
        nn.GELU: M.GELU,
        nn.Hardswish: M.Hardswish,
        nn.LogSigmoid: M.LogSigmoid,
        nn.Mish: M.Mish,
        nn.SELU: M.SELU,
        nn.Sigmoid: M.Sigmoid,
        nn.SiLU: M.SiLU,
        nn.Softplus: M.Softplus,
        nn.Softsign: M.Softsign,
        nn.Tanh: M.Tanh,
        nn.Tanhshrink: M.Tanhshrink,
    }
    # two-valued derivatives: exact from a 1-bit mask (ReLU, LeakyReLU, ReLU6 and Hardtanh are
    # the layer-swap route's own Q-layers and are not listed)
    piecewise = {
        nn.Threshold: M.Threshold,
        nn.Hardsigmoid: M.Hardsigmoid,
        nn.Hardshrink: M.Hardshrink,
        nn.Softshrink: M.Softshrink,
    }
    return smooth, piecewise


_TABLES: tuple[dict[type, type], dict[type, type]] | None = None


def _activation_tables() -> tuple[dict[type, type], dict[type, type]]:
    """(smooth, piecewise): activation class -> its few-bit subclass (built-ins + registered)."""
    global _TABLES
    if _TABLES is None:
        _TABLES = _builtin_tables()
    return _TABLES


def register_activation(stock: type[nn.Module], fewbit: type[nn.Module], *, smooth: bool) -> None:
    """Make ``convert`` (and ``Controller(fewbit_bits=...)``) swap ``stock`` activations (that
    exact type) for ``fewbit``: a subclass of ``stock`` with a ``bits`` attribute whose
    forward is ``stock``'s output with a few-bit derivative (e.g. transformers' activation
    classes, registered by act-hf). ``smooth``: takes ``fewbit_bits``; else 1 bit (exact).
    Registering the same pair again is a no-op."""
    if not (isinstance(fewbit, type) and isinstance(stock, type) and issubclass(fewbit, stock)):
        raise TypeError(f"register_activation: {fewbit!r} must be a subclass of {stock!r}")
    smooth_table, piecewise = _activation_tables()
    table = smooth_table if smooth else piecewise
    known = table.get(stock)
    if known is not None and known.__qualname__ != fewbit.__qualname__:
        raise ValueError(f"register_activation: {stock.__name__} already swaps to {known.__name__}")
    table[stock] = fewbit


def fewbit_target(module: nn.Module) -> tuple[type[nn.Module] | None, bool]:
    """The few-bit class for a plain torch activation ``module`` and whether it is smooth
    (needs a ``bits`` choice); ``(None, False)`` for anything else (subclasses included)."""
    return fewbit_target_of(type(module))


def fewbit_target_of(cls: type) -> tuple[type[nn.Module] | None, bool]:
    """:func:`fewbit_target` for a class."""
    smooth, piecewise = _activation_tables()
    if cls in smooth:
        return smooth[cls], True
    if cls in piecewise:
        return piecewise[cls], False
    return None, False


def is_fewbit(module: nn.Module) -> bool:
    """Whether ``module`` is already a few-bit activation (actcore's or a registered one)."""
    from .modules import FewBitActivation

    if isinstance(module, FewBitActivation):
        return True
    smooth, piecewise = _activation_tables()
    cls = type(module)
    return cls in smooth.values() or cls in piecewise.values()


def swap_activation(module: nn.Module, bits: int | None) -> str | None:
    """Turn a plain torch activation into its few-bit subclass, in place (same object, so
    hooks and ``state_dict`` stay; activations have no state). Smooth activations get
    ``bits`` (1..4), piecewise-linear ones 1 bit (exact). Returns the new class name, or
    None when ``module`` is not swappable or is smooth and ``bits`` is None. A module that is
    already few-bit gets ``bits`` (when given, for smooth ones)."""
    from .tables import check_bits

    if bits is not None:
        check_bits(bits)
    if is_fewbit(module):
        if bits is not None and type(module) in _activation_tables()[0].values():
            module.bits = bits  # type: ignore[assignment]
        return type(module).__name__
    target, smooth = fewbit_target(module)
    if target is None or (smooth and bits is None):
        return None
    module.__class__ = target
    module.bits = bits if smooth else 1  # type: ignore[assignment]
    return target.__name__
