"""``OpMode``: what the saved-tensor hooks need to know about the op that is saving.

A pack hook sees only the tensor, and autograd saves an op's inputs before the op runs,
so neither the hook nor a dispatch mode can tell which op saved a tensor. A
:class:`torch.overrides.TorchFunctionMode` wraps the whole Python-level call instead.
:class:`OpMode` (pushed together with the hooks) tells the hooks:

* ``depth > 0`` inside an op whose backward compares or divides saved values
  (:mod:`actcore.exact_ops`): what it saves is kept exact;
* ``attention > 0`` inside ``F.scaled_dot_product_attention`` or
  ``F.multi_head_attention_forward``: the float tensors they create and save outside the
  autograd graph (sdpa's ``logsumexp``; not their inputs) are kept exact, as quantizing
  them gives NaN gradients;

and, given a ``router`` (:class:`actcore.routing.FunctionalRouter`), it hands functional calls
(``F.relu``, ``F.gelu``, ``F.layer_norm``, ``F.dropout``...) to the tailored autograd
functions of the layer-swap route, so a model's functional code is compressed as its
modules are. The mode sees the outermost call only (a call made inside another torch
function's Python body, or from C++, is not seen).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .exact_ops import ExactOps, _lookup

__all__ = ["ATTENTION_FUNCTIONS", "OpMode", "created_by_attention", "outside_function_modes"]

ATTENTION_FUNCTIONS = frozenset({F.scaled_dot_product_attention, F.multi_head_attention_forward})
"""Calls inside which float tensors saved outside the autograd graph stay exact."""


def _is_attention(func: Any) -> bool:
    try:
        return func in ATTENTION_FUNCTIONS
    except TypeError:  # an unhashable callable: none of these
        return False


def _inputs(args: tuple, kwargs: dict) -> tuple[frozenset[int], int]:
    """Storages of the tensor arguments, and the most elements one of them has."""
    ptrs, numel = set(), 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            numel = max(numel, a.numel())
            with contextlib.suppress(RuntimeError, NotImplementedError):
                ptrs.add(a.untyped_storage().data_ptr())
    return frozenset(ptrs), numel


def created_by_attention(mode: OpMode | None, t: torch.Tensor, storage: int) -> bool:
    """Whether ``t`` (on ``storage``) is a statistic an attention call made and saved outside
    the autograd graph (sdpa's ``logsumexp``): a float tensor without history, not on an
    input's storage, at most a quarter of the largest input (it lacks the head dim)."""
    return (
        mode is not None
        and mode.attention > 0
        and t.grad_fn is None
        and not t.requires_grad
        and 4 * t.numel() <= mode.attention_numel
        and storage not in mode.attention_inputs
    )


class OpMode(ExactOps):
    """:class:`~actcore.exact_ops.ExactOps` plus attention tagging and functional routing.

    ``suspended`` (a zero-argument callable): while it returns True (an excluded module is
    running), calls go through untouched.
    """

    def __init__(self, router: Any = None, suspended: Any = None, exact: bool = True) -> None:
        super().__init__()
        self.attention = 0
        self.attention_inputs: frozenset[int] = frozenset()  # storages of the calls' tensors
        self.attention_numel = 0  # the most elements of one of those tensors
        self.router = router
        self.suspended = suspended
        self.exact = exact

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.suspended is not None and self.suspended():
            return func(*args, **kwargs)
        check = _lookup(func) if self.exact else None
        if check is not None and check(args, kwargs):
            self.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.depth -= 1
        if self.router is not None:
            out = self.router(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if _is_attention(func):
            outer = self.attention_inputs, self.attention_numel
            storages, numel = _inputs(args, kwargs)
            self.attention_inputs = outer[0] | storages
            self.attention_numel = max(outer[1], numel)
            self.attention += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.attention -= 1
                self.attention_inputs, self.attention_numel = outer
        return func(*args, **kwargs)


@contextlib.contextmanager
def outside_function_modes() -> Iterator[None]:
    """Run the block with the torch function modes popped (pushed back after).

    Q-layers run their own Python machinery (choosing and packing compressors) under it:
    through an active mode every tensor attribute read would be a Python call.
    """
    depth = torch._C._len_torch_function_stack()
    if not depth:
        yield
        return
    modes = [torch._C._pop_torch_function_stack() for _ in range(depth)]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)
