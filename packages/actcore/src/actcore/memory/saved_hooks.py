"""The tracker's identity saved-tensor hooks, the registry of active trackers they record
into, and which saved-tensor hooks are on top (helpers private to :mod:`actcore.memory`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

__all__: list[str] = []


class _ActiveTracker(Protocol):
    """What the registry needs of an active tracker (an :class:`actcore.memory.Tracker`)."""

    _cuda_device: torch.device | None
    _cuda_carry: int

    def _record(self, t: Tensor, holder: Tensor, owner: str | None = None) -> None: ...

    def _note_outputs(self, outputs: Any) -> None: ...


# Active trackers, outermost first. Every recorded tensor goes to all of them.
ACTIVE_TRACKERS: list[_ActiveTracker] = []

# torch >= 2.8 can read the saved-tensor hook stack; older torch is probed (see hooks_state).
_TOP_HOOKS: Callable[..., Any] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None
)
_HOOKS_ENABLED: Callable[[], bool] | None = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", None
)


class _Saved:
    """What the tracker's pack hook stores: a detached alias and the version at save time."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


PROBE: dict[str, Any] = {"leaf": None, "running": False, "seen": False}


def pack_hook(t: Tensor) -> _Saved:
    """Record ``t`` in every active tracker; keep a detached alias (no reference cycle)."""
    alias = t.detach()
    if PROBE["running"] and t is PROBE["leaf"]:
        PROBE["seen"] = True
    else:
        for tracker in ACTIVE_TRACKERS:
            tracker._record(t, alias)
    return _Saved(alias, t._version)


def unpack_hook(saved: _Saved) -> Tensor:
    """Return the alias, after autograd's own in-place check (hooks turn that check off)."""
    t = saved.tensor
    if t._version != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {saved.version} instead. (Seen by actcore.memory's saved-tensor "
            "hooks; enable anomaly detection with torch.autograd.set_detect_anomaly(True) to "
            "find the operation that failed to compute its gradient.)"
        )
    return t


def top_hooks() -> tuple[Any, Any] | None:
    """The innermost active saved-tensor hooks ``(pack, unpack)``; None without any, and on
    a torch that cannot say (before 2.8: :func:`hooks_state` probes instead)."""
    if _TOP_HOOKS is None:
        return None
    try:
        return _TOP_HOOKS(True)
    except TypeError:  # a build whose accessor takes no argument
        return _TOP_HOOKS()


def hooks_state() -> str:
    """Which saved-tensor hooks are on top now: 'none', 'own', 'foreign' or 'disabled'."""
    if _HOOKS_ENABLED is not None and not _HOOKS_ENABLED():
        return "disabled"
    if _TOP_HOOKS is not None:
        top = top_hooks()
        if top is None:
            return "none"
        return "own" if top[0] is pack_hook else "foreign"
    return _probe_hooks()


def _probe_hooks() -> str:
    """Find the top hooks on torch < 2.8 by saving a one-element tensor (never unpacked)."""
    if torch.is_inference_mode_enabled():
        return "foreign"  # cannot tell; never override hooks we cannot see
    if PROBE["leaf"] is None:
        PROBE["leaf"] = torch.zeros(1, requires_grad=True)
    leaf = PROBE["leaf"]
    PROBE["running"], PROBE["seen"] = True, False
    try:
        with torch.enable_grad():
            out = leaf.mul(leaf)
    except Exception:
        return "foreign"
    finally:
        PROBE["running"] = False
    if PROBE["seen"]:
        return "own"
    try:  # raises when the saved tensor already went through (foreign) default hooks
        out.grad_fn._raw_saved_self.register_hooks(torch.Tensor.detach, lambda x: x)
    except RuntimeError:
        return "foreign"
    return "none"
