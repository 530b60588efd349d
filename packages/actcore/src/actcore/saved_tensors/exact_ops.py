"""Ops whose backward needs the exact saved values, and a mode that tells the hooks so.

Most backward formulas use saved activations *arithmetically*, so a stochastically
rounded copy gives an unbiased or slightly perturbed gradient. A few compare them instead:

* ``amax``/``amin``, full ``max()``/``min()``, ``median``/``nanmedian``, ``maximum``/
  ``minimum``/``fmax``/``fmin`` and ``scatter_reduce``/``index_reduce`` with ``"amax"``/
  ``"amin"`` route the gradient to the elements *equal* to the result; once the saved
  input is quantized none is equal any more and the gradient becomes NaN (0/0) or zero;
* inf-norms (``norm``, ``linalg.vector_norm``/``matrix_norm``/``norm``, ``normalize``
  with ``p``/``ord`` = +-inf) do the same through ``|x| == norm``;
* ``prod`` (and ``"prod"`` reductions) divides by the saved input, ``logsumexp``
  exponentiates its difference to the saved result: a rounding error of one step becomes
  an error of ``exp(step)``.

:class:`ExactOps` is a :class:`torch.overrides.TorchFunctionMode` that counts when the
program is inside one of these calls; :class:`actcore.saved_tensors.hooks.SavedTensorHooks` keeps
every tensor saved meanwhile exact. The mode sees calls made from Python (``x.amax()``,
``torch.maximum``, PyG's ``scatter(reduce="max")``...), not ops that C++ code reaches
internally.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ExactOps", "needs_exact_saves"]

_Predicate = Callable[[tuple, dict], bool]


def _always(args: tuple, kwargs: dict) -> bool:
    return True


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _reduce_at(index: int) -> _Predicate:
    def check(args: tuple, kwargs: dict) -> bool:
        return _arg(args, kwargs, index, "reduce", None) in ("amax", "amin", "prod")

    return check


def _inf_norm(index: int, name: str) -> _Predicate:
    def check(args: tuple, kwargs: dict) -> bool:
        p = _arg(args, kwargs, index, name, None)
        return isinstance(p, int | float) and math.isinf(p)

    return check


def _table() -> dict[Any, _Predicate]:
    table: dict[Any, _Predicate] = {}
    for name in (
        "amax",
        "amin",
        "max",
        "min",
        "maximum",
        "minimum",
        "fmax",
        "fmin",
        "median",
        "nanmedian",
        "prod",
        "logsumexp",
    ):
        for owner in (torch, torch.Tensor):
            table[getattr(owner, name)] = _always
    # torch.f(input, dim, index, src, reduce) and Tensor.f(self, dim, index, src, reduce)
    for name in ("scatter_reduce", "index_reduce"):
        table[getattr(torch, name)] = _reduce_at(4)
        table[getattr(torch.Tensor, name)] = _reduce_at(4)
        table[getattr(torch.Tensor, name + "_")] = _reduce_at(4)
    table[torch.norm] = _inf_norm(1, "p")
    table[torch.Tensor.norm] = _inf_norm(1, "p")
    table[torch.nn.functional.normalize] = _inf_norm(1, "p")
    table[torch.linalg.norm] = _inf_norm(1, "ord")
    table[torch.linalg.vector_norm] = _inf_norm(1, "ord")
    table[torch.linalg.matrix_norm] = _inf_norm(1, "ord")
    return table


_NEEDS_EXACT = _table()


def exact_check(func: Any) -> _Predicate | None:
    try:
        return _NEEDS_EXACT.get(func)
    except TypeError:  # an unhashable callable: none of ours
        return None


def needs_exact_saves(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether ``func(*args, **kwargs)``'s backward needs its saved tensors exact."""
    check = exact_check(func)
    return check is not None and check(args, kwargs or {})


class ExactOps(TorchFunctionMode):
    """While active, ``depth > 0`` exactly when inside a call of :func:`needs_exact_saves`."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        check = exact_check(func)
        if check is None or not check(args, kwargs):
            return func(*args, **kwargs)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1
