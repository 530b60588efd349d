"""``OpMode``: what the saved-tensor hooks need to know about the op that is saving.

A pack hook sees only the tensor, and autograd saves an op's inputs before the op runs,
so neither the hook nor a dispatch mode can tell which op saved a tensor. A
:class:`torch.overrides.TorchFunctionMode` wraps the whole Python-level call instead.
:class:`OpMode` (pushed together with the hooks) tells the hooks:

* ``depth > 0`` inside an op whose backward compares or divides saved values
  (:mod:`actcore.saved_tensors.exact_ops`): what it saves is kept exact;
* ``floored_input`` and ``floored_kind``: the storage of the input of the call of
  :data:`FLOORED_INPUTS` now running (0 outside one) and its kind: ``"batch_norm"`` (more
  bits on small maps) or ``"activation"`` (a smooth activation, whose backward evaluates
  its derivative at the saved input: at least 4 bits, as the layer route keeps it);
* ``attention > 0`` inside ``F.scaled_dot_product_attention`` or
  ``F.multi_head_attention_forward``: the float tensors they create and save outside the
  autograd graph (sdpa's ``logsumexp``; not their inputs) are kept exact, as quantizing
  them gives NaN gradients;

and, given a ``router`` (:class:`actcore.layers.routing.FunctionalRouter`), it hands
functional calls (``F.relu``, ``F.gelu``, ``F.layer_norm``, ``F.dropout``...) to the
tailored autograd functions of the layer-swap route, so a model's functional code is
compressed as its modules are. The mode sees the outermost call only (a call made inside
another torch function's Python body, or from C++, is not seen).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .exact_ops import ExactOps, exact_check

__all__ = [
    "ATTENTION_FUNCTIONS",
    "DERIVED_OUTPUTS",
    "FLOORED_INPUTS",
    "DataMarks",
    "OpMode",
    "call_outside_modes",
    "created_by_attention",
    "outside_function_modes",
    "plain_float",
    "plain_tensor",
    "recomputed",
    "wants_grad",
]

ATTENTION_FUNCTIONS = frozenset({F.scaled_dot_product_attention, F.multi_head_attention_forward})
"""Calls inside which float tensors saved outside the autograd graph stay exact."""

FLOORED_INPUTS: dict[Any, str] = {
    F.batch_norm: "batch_norm",
    **dict.fromkeys(
        (
            F.gelu,
            F.silu,
            F.mish,
            F.hardswish,
            F.softplus,
            F.elu,
            F.selu,
            F.celu,
            F.logsigmoid,
            torch.tanh,
            torch.sigmoid,
            torch.Tensor.tanh,
            torch.Tensor.sigmoid,
        ),
        "activation",
    ),
}
"""Calls whose saved input gets a bits floor, by kind: ``"batch_norm"``
(:func:`actcore.layers.roles.batch_norm_bits`), ``"activation"`` (nonlinear backward at 4 bits)."""

DERIVED_OUTPUTS = frozenset(
    {f for f, kind in FLOORED_INPUTS.items() if kind == "activation"}
    | {F.layer_norm, F.group_norm, *([F.rms_norm] if hasattr(F, "rms_norm") else [])}
)
"""Calls whose output the layer route derives from their packed input: traced by Dynamo
under a converted model's scope they run :func:`recomputed`, so the compiled graph saves
their input once and backward recomputes the output from it, not a second, separately
packed copy."""

# what a recomputed call keeps from its forward: its statistics (a few values per row),
# exact; backward recomputes the rest against them
_STATISTICS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("mean", "sum", "var_mean", "var", "std", "std_mean")
    if hasattr(torch.ops.aten, name)
)


def _statistics_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's choice for ``op`` in a recomputed call: a reduction's output
    saved, everything else recomputed."""
    if getattr(op, "overloadpacket", op) in _STATISTICS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _statistics_saved() -> Any:
    return create_selective_checkpoint_contexts(_statistics_policy)


_RECOMPUTED: dict[str, Any] = {"use_reentrant": False, "context_fn": _statistics_saved}
if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
    # what the checkpoint saves goes through the scope's hooks too (torch's future default)
    _RECOMPUTED["respect_saved_tensors_hooks"] = True


def recomputed(func: Any, *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` (traced by Dynamo) in a non-reentrant selective checkpoint:
    the compiled graph saves its inputs and its statistics (the means of a decomposed norm,
    exact), and backward recomputes the rest from them. With the statistics saved, backward
    normalizes a norm's packed input by the forward's own; recomputed from the packed input,
    they would take in its rounding noise."""
    return checkpoint(func, *args, **_RECOMPUTED, **kwargs)


def _floor_kind(func: Any) -> str | None:
    try:
        return FLOORED_INPUTS.get(func)
    except TypeError:  # an unhashable callable: none of these
        return None


def _is_one_of(func: Any, functions: frozenset) -> bool:
    try:
        return func in functions
    except TypeError:  # an unhashable callable: none of these
        return False


def _draws_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an attention call draws dropout. Recomputed in a checkpoint, it would have
    the compiled forward save torch's random state for backward's replay, a saved tensor
    AOTAutograd's inlining of saved-tensor hooks fails on (it finds no backward input of its
    name); such a call is traced as it is, its saved tensors packed like any other."""
    if func is F.multi_head_attention_forward:
        p = kwargs.get("dropout_p", args[10] if len(args) > 10 else 0.0)
        training = kwargs.get("training", args[13] if len(args) > 13 else True)
        return bool(training) and p != 0
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)  # (sdpa)
    return p != 0


def wants_grad(*tensors: Any) -> bool:
    """Grad mode is on and one of ``tensors`` requires grad (a routed call saves)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def plain_tensor(x: Any) -> bool:
    """A strided tensor or parameter, no subclass: what routed calls take."""
    return type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided


def plain_float(x: Any) -> bool:
    """A :func:`plain_tensor` of a floating dtype."""
    return plain_tensor(x) and x.is_floating_point()


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


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


class DataMarks:
    """Tensors without autograd history that derive from a forward's floating inputs.

    Such a tensor (node features after a no-grad dropout, an input cast or reshaped) is
    data, compressed like any activation; one without history that does not derive from
    the inputs (rotary cos/sin, position tables, masks made in the forward) is a constant of
    the forward, kept exact. Marks follow the ops the mode sees: an output is marked when a
    tensor argument is. Marks are by storage (views of marked data, such as the reshapes a
    composite op saves, are data too) and last while the marked tensor lives.
    """

    def __init__(self) -> None:
        self._ids: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        key = _storage(t)
        if key:
            self._ids[key] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._ids.get(_storage(t))
        return ref is not None and ref() is not None

    def follow(self, out: Any, args: tuple, kwargs: dict) -> None:
        """Mark ``out`` (a tensor or a sequence of them) if a tensor argument is marked."""
        if isinstance(out, torch.Tensor):
            if out.requires_grad or not self._ids:
                return
            outs: tuple = (out,)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            outs = tuple(o for o in out if isinstance(o, torch.Tensor) and not o.requires_grad)
            if not outs or not self._ids:
                return
        else:
            return
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a in self:
                for o in outs:
                    self.add(o)
                return


class OpMode(ExactOps):
    """:class:`~actcore.saved_tensors.exact_ops.ExactOps` plus attention tagging and
    functional routing.

    ``suspended`` (a zero-argument callable): while it returns True (an excluded module is
    running), calls go through untouched.
    """

    def __init__(
        self,
        router: Any = None,
        suspended: Any = None,
        exact: bool = True,
        marks: DataMarks | None = None,
    ) -> None:
        super().__init__()
        self.marks = marks
        self.attention = 0
        self.attention_inputs: frozenset[int] = frozenset()  # storages of the calls' tensors
        self.attention_numel = 0  # the most elements of one of those tensors
        self.floored_input = 0  # storage of the running FLOORED_INPUTS call's input
        self.floored_kind: str | None = None
        self.router = router
        self.suspended = suspended
        self.exact = exact
        self.recompute_attention = False  # under Dynamo: sdpa in a checkpoint (see below)
        self.recompute_derived = False  # under Dynamo: DERIVED_OUTPUTS calls in a checkpoint

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Dynamo traces this mode: compiled graphs get their treatment from the graphs
            # inlined into them (actcore.saved_tensors.compiled), not from per-call state;
            # attention is recomputed in backward from its saved (packed) q, k, v
            if (
                self.recompute_attention
                and _is_one_of(func, ATTENTION_FUNCTIONS)
                and not _draws_dropout(func, args, kwargs)
            ) or (self.recompute_derived and _is_one_of(func, DERIVED_OUTPUTS)):
                return recomputed(func, *args, **kwargs)
            return func(*args, **kwargs)
        if self.suspended is not None and self.suspended():
            return func(*args, **kwargs)
        check = exact_check(func) if self.exact else None
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
        if _is_one_of(func, ATTENTION_FUNCTIONS):
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
        kind = _floor_kind(func)
        if kind is not None:
            outer = self.floored_input, self.floored_kind
            x = args[0] if args else kwargs.get("input")
            self.floored_input = _storage(x) if isinstance(x, torch.Tensor) else 0
            self.floored_kind = kind
            try:
                out = func(*args, **kwargs)
            finally:
                self.floored_input, self.floored_kind = outer
        else:
            out = func(*args, **kwargs)
        if self.marks is not None:
            self.marks.follow(out, args, kwargs)
        if self.router is not None:
            self.router.after(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def outside_function_modes() -> Iterator[list[Any]]:
    """Run the block with the torch function modes popped (pushed back after); yields them.

    Q-layers run their own Python machinery (choosing and packing compressors) under it:
    through an active mode every tensor attribute read would be a Python call.
    """
    depth = torch._C._len_torch_function_stack()
    if not depth:
        yield []
        return
    modes = [torch._C._pop_torch_function_stack() for _ in range(depth)]
    try:
        yield modes
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def call_outside_modes(fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` outside the torch function modes; an :class:`OpMode`'s data
    marks still follow from the arguments to the result."""
    with outside_function_modes() as modes:
        out = fn(*args, **kwargs)
    for mode in modes:
        if isinstance(mode, OpMode) and mode.marks is not None:
            mode.marks.follow(out, args, kwargs)
            break
    return out
