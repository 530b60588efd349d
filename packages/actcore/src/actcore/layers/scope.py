"""``ModelScope``: compress everything a converted model's forward saves, not only its Q-layers.

``actcore.convert`` attaches one to the root module (``model.act_scope``). From the root's
forward pre-hook to its forward hook (and only then, only on the thread running that
forward) it pushes

* the saved-tensor hooks of :mod:`actcore.saved_tensors.hooks` (its ``saved_tensor_hooks``
  attribute), which compress every other floating tensor autograd saves (functional ops,
  elementwise products, inline attention, a loss computed in the model) at the level's
  ``other_bits``, with the tailored choices of
  :class:`actcore.saved_tensors.hooks.SavedTensorHooks` (softmax / sigmoid / tanh
  outputs at 4 bits at least, log-probabilities and the forward's own constants exact),
  while tensors a Q-layer packed pass through (and a tensor a Q-layer packed is not stored
  twice), and
* an :class:`actcore.saved_tensors.op_mode.OpMode` with a
  :class:`actcore.layers.routing.FunctionalRouter`, so functional ReLUs, dropouts, smooth
  activations and normalizations get the Q-layers' tailored compressors.

Re-entrant (a nested or recursive call of the root enters once), and a no-op without a
pending backward (``torch.no_grad``, inference). Modules excluded from conversion run
with the hooks suspended: what they save stays as it is.

The hooks on the model are plain functions that look ``act_scope`` up on the module they
run for, so ``copy.deepcopy`` and pickling of a converted model work (the copy gets its
own scope).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config import LevelSpec, level_spec
from ..policies import FixedBits
from ..saved_tensors.graph_treatment import KindBits
from ..saved_tensors.hooks import SavedTensorHooks
from .routing import FunctionalRouter

__all__ = [
    "ModelScope",
    "attach_scope",
    "detach_scope",
    "hook_bits",
    "scope_exact",
    "set_scope_exact",
]

_ACTIVE = threading.local()  # .stack: the scopes entered on this thread, innermost last


def hook_bits(spec: LevelSpec) -> int | None:
    """Bits the scope's hooks give a saved tensor at a level: its ``other_bits``."""
    return spec.other_bits


class ModelScope:
    """The whole-model compression of one converted root module (see the module docstring)."""

    def __init__(self, spec: LevelSpec, *, fewbit_bits: int | None) -> None:
        self.spec = spec
        self.fewbit_bits = fewbit_bits
        self._build()

    def _build(self) -> None:
        bits = hook_bits(self.spec)
        self.saved_tensor_hooks = SavedTensorHooks(
            FixedBits(bits, swap=self.spec.swap),
            tailored=True,
            router=FunctionalRouter(self.spec, self.fewbit_bits),
            module_keys=False,
            kind_bits=KindBits(
                product=self.spec.conv_bits,
                batch_norm=self.spec.norm_bits,
                row_norm=self.spec.row_norm_bits,
                activation=self.spec.activation_bits,
            ),
        )
        self._local = threading.local()

    # ---- entering and leaving ---------------------------------------------------------------

    def enter(self, root: nn.Module, inputs: Iterable[Any]) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth or not torch.is_grad_enabled():
            return
        if self.saved_tensor_hooks.model is not root:
            self.saved_tensor_hooks.attach(root)
        else:
            self.saved_tensor_hooks.refresh_params()
        self.saved_tensor_hooks.set_inputs(inputs)
        self.saved_tensor_hooks.__enter__()
        self._local.entered = True
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self)

    def exit(self) -> None:
        depth = getattr(self._local, "depth", 1) - 1
        self._local.depth = depth
        if depth == 0 and getattr(self._local, "entered", False):
            self._local.entered = False
            stack = getattr(_ACTIVE, "stack", [])
            if stack and stack[-1] is self:
                stack.pop()
            self.saved_tensor_hooks.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        """Whether this thread is inside the scope (in the root's forward, hooks pushed)."""
        return self.saved_tensor_hooks.active

    # ---- copies -----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"level": self.spec.name, "fewbit_bits": self.fewbit_bits}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec = level_spec(state["level"])
        self.fewbit_bits = state["fewbit_bits"]
        self._build()

    def __repr__(self) -> str:
        return (
            f"ModelScope(level={self.spec.name!r}, bits={hook_bits(self.spec)}, "
            f"fewbit_bits={self.fewbit_bits})"
        )


# ---- the hooks on the model: plain functions, so copies of the model work -------------------


@torch.compiler.disable
def _root_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
    scope = module.__dict__.get("act_scope")
    if isinstance(scope, ModelScope):
        scope.enter(module, (*args, *kwargs.values()))


@torch.compiler.disable
def _root_post(module: nn.Module, args: Any, output: Any) -> None:
    scope = module.__dict__.get("act_scope")
    if isinstance(scope, ModelScope):
        scope.exit()


def _innermost() -> ModelScope | None:
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


def _excluded_pre(module: nn.Module, args: Any) -> None:
    scope = _innermost()
    if scope is not None:
        scope.saved_tensor_hooks.suspend()
        module.__dict__.setdefault("_act_suspended", []).append(scope)


def _excluded_post(module: nn.Module, args: Any, output: Any) -> None:
    held = module.__dict__.get("_act_suspended")
    if held:
        held.pop().saved_tensor_hooks.resume()


_EXACT = "act_scope_exact"


def set_scope_exact(module: nn.Module, exact: bool | None) -> None:
    """Inside ``module``'s forward, the model scope keeps what is saved as it is (``True``)
    or compresses it (``False``), whatever the modules around it say; ``None`` (the
    default): as they say. A memory plan's per-block choice; Q-layers keep their own
    levels either way."""
    if exact is None:
        module.__dict__.pop(_EXACT, None)
        _remove_hooks(module, (_exact_pre, _exact_post))
        return
    module.__dict__[_EXACT] = bool(exact)
    if not _has_hook(module._forward_pre_hooks, _exact_pre):
        module.register_forward_pre_hook(_exact_pre)
        module.register_forward_hook(_exact_post, always_call=True)


def scope_exact(module: nn.Module) -> bool | None:
    """What :func:`set_scope_exact` set on ``module`` (None: nothing)."""
    return module.__dict__.get(_EXACT)


def _exact_pre(module: nn.Module, args: Any) -> None:
    scope = _innermost()
    if scope is not None and _EXACT in module.__dict__:
        scope.saved_tensor_hooks.push_exact(module.__dict__[_EXACT])
        module.__dict__.setdefault("_act_exact_pushed", []).append(scope)


def _exact_post(module: nn.Module, args: Any, output: Any) -> None:
    held = module.__dict__.get("_act_exact_pushed")
    if held:
        held.pop().saved_tensor_hooks.pop_exact()


def _has_hook(hooks: dict, fn: Any) -> bool:
    return any(h is fn for h in hooks.values())


def attach_scope(
    model: nn.Module, spec: LevelSpec, *, fewbit_bits: int | None, excluded: list[nn.Module]
) -> ModelScope:
    """Give ``model`` a :class:`ModelScope` (replacing an earlier one), hooks included."""
    scope = ModelScope(spec, fewbit_bits=fewbit_bits)
    model.act_scope = scope
    _forward_of_our_own(model)
    if not _has_hook(model._forward_pre_hooks, _root_pre):
        model.register_forward_pre_hook(_root_pre, with_kwargs=True)
        model.register_forward_hook(_root_post, always_call=True)
    for module in model.modules():
        marked = _has_hook(module._forward_pre_hooks, _excluded_pre)
        if any(module is m for m in excluded):
            if not marked:
                module.register_forward_pre_hook(_excluded_pre)
                module.register_forward_hook(_excluded_post, always_call=True)
        elif marked:
            _remove_hooks(module, (_excluded_pre, _excluded_post))
    return scope


def detach_scope(model: nn.Module) -> None:
    """Remove ``model``'s scope and its hooks (Q-layers stay)."""
    for module in model.modules():
        _remove_hooks(module, (_root_pre, _root_post, _excluded_pre, _excluded_post))
    if isinstance(model.__dict__.get("act_scope"), ModelScope):
        model.act_scope = None
    base = _OWN_FORWARD_BASES.get(type(model))
    if base is not None:
        model.__class__ = base


_OWN_FORWARD: dict[type, type] = {}  # a torch.nn class -> its subclass with our forward
_OWN_FORWARD_BASES: dict[type, type] = {}  # and back


def _forward_of_our_own(model: nn.Module) -> None:
    """Give a root whose ``forward`` ``torch.nn`` defines (``nn.Sequential``,
    ``nn.TransformerEncoder``...) a subclass of its class whose ``forward`` is defined here
    and calls it. ``torch.compile`` traces such a module's whole call, hooks included, where it runs
    the hooks of any other module outside the compiled frame; the scope's pre-hook must run
    there (it pushes the hooks the compiled graphs inline), and traced it broke the graph
    (``fullgraph=True`` failed on a converted ``nn.Sequential``). Same name, state and
    behaviour; ``detach_scope`` gives the class back."""
    cls = type(model)
    if cls in _OWN_FORWARD_BASES or not _torch_forward(cls):
        return
    own = _OWN_FORWARD.get(cls)
    if own is None:
        torch_forward = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return torch_forward(self, *args, **kwargs)

        # a module-level name, so converted models pickle; the class's own name in reprs
        qualname = "Scoped_" + re.sub(r"\W", "_", f"{cls.__module__}.{cls.__qualname__}")
        forward.__qualname__ = f"{qualname}.forward"
        own = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__})
        own.__qualname__ = qualname
        globals()[qualname] = own
        _OWN_FORWARD[cls], _OWN_FORWARD_BASES[own] = own, cls
    model.__class__ = own


def _torch_forward(cls: type) -> bool:
    """Whether ``cls.forward`` is defined in ``torch.nn`` (whose module calls torch.compile
    traces whole)."""
    module = getattr(getattr(cls, "forward", None), "__module__", None) or ""
    return module.startswith("torch.nn.")


def _remove_hooks(module: nn.Module, fns: tuple) -> None:
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if any(h is f for f in fns)]:
            del hooks[key]
            for extra in (
                module._forward_pre_hooks_with_kwargs,
                module._forward_hooks_with_kwargs,
                module._forward_hooks_always_called,
            ):
                extra.pop(key, None)
