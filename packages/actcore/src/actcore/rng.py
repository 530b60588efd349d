"""Per-model streams of stochastic-rounding seeds.

Each converted model (and each :class:`actcore.Controller`) owns a :class:`SeedStream`: the
seeds of the tensors it quantizes are ``mix(seed, n)`` for ``n = 0, 1, 2, ...`` in the order
its forward packs them. The stream is made active on the thread running the model's forward
(:func:`active`), so what a model's noise is depends on its own seed and history only: not on
other models, other threads, or what ran before it. ``seed`` defaults to a hash of torch's
default CPU generator state when the stream is made (``convert``/``Controller`` time), which
reads the generator without drawing from it (the user's random stream is unchanged); pass
``seed=`` for a fixed one. :meth:`SeedStream.state_dict` holds ``(seed, count)``: save it with
the model to resume bit for bit. Without an active stream, :func:`actcore.ops.new_seed`
falls back to its process-wide counter.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .config import config
from .ops.noise import MASK32, SEED_LIMIT, mix32

__all__ = [
    "SeedStream",
    "active",
    "attach_stream",
    "check_stream_seed",
    "current",
    "forward_raised",
    "release",
    "transforms_active",
    "using",
]

_LOCAL = threading.local()  # .stack: the streams entered on this thread, innermost last


def _seed_from_torch() -> int:
    """A seed from torch's default generator state, without drawing from it."""
    state = torch.get_rng_state().numpy().tobytes()
    digest = hashlib.blake2b(state, digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def check_stream_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**63) or None, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


class SeedStream:
    """Seeds ``mix(seed, 0), mix(seed, 1), ...``; thread-safe, with a ``state_dict``."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = _seed_from_torch() if seed is None else check_stream_seed(seed)
        self.count = 0
        self._lock = threading.Lock()

    def next_seed(self) -> int:
        with self._lock:
            n = self.count
            self.count += 1
        hi = mix32((self.seed >> 32) ^ mix32(n >> 32 & MASK32))
        lo = mix32((self.seed & MASK32) ^ mix32(n & MASK32) ^ hi)
        return ((hi << 32) | lo) % SEED_LIMIT

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (checked first; nothing changes on error)."""
        if not isinstance(state, dict) or {"seed", "count"} - set(state):
            raise KeyError(f"a SeedStream state needs 'seed' and 'count', got {state!r}")
        seed, count = check_stream_seed(state["seed"]), state["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"SeedStream state count must be an int >= 0, got {count!r}")
        with self._lock:
            self.seed, self.count = seed, count

    def __getstate__(self) -> dict[str, int]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self.seed, self.count = state["seed"], state["count"]

    def __repr__(self) -> str:
        return f"SeedStream(seed={self.seed}, count={self.count})"


def current() -> SeedStream | None:
    """The innermost active stream on this thread, if any."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def using(stream: SeedStream | None) -> Iterator[None]:
    """Make ``stream`` the active one on this thread inside the block (None: no change)."""
    if stream is None:
        yield
        return
    active(stream)
    try:
        yield
    finally:
        release(stream)


def active(stream: SeedStream) -> None:
    """Push ``stream`` on this thread (pair with :func:`release`)."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(stream)


def release(stream: SeedStream) -> None:
    """Pop ``stream`` (the innermost occurrence) from this thread's stack."""
    stack = getattr(_LOCAL, "stack", [])
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is stream:
            del stack[i]
            return


# ---- on a model: the root's forward makes its stream active ---------------------------------


def forward_raised(output: Any) -> bool:
    """In a forward hook registered with ``always_call=True``: whether the forward raised
    (torch then calls it with no output, while the exception is being handled)."""
    return output is None and sys.exc_info()[0] is not None


def _compresses(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` keeps compressed tensors (a scope, or a converted layer
    whose level compresses or swaps); at L0 every layer runs plain PyTorch."""
    return any(
        module.__dict__.get("act_scope") is not None
        # a converted layer (act_spec None: the process-wide level)
        or (hasattr(module, "act_spec") and (module.act_spec or config.spec).packs)
        for module in model.modules()
    )


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, ...) is running."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active is not None and active())


def _refuse_functorch(module: torch.nn.Module) -> None:
    """A converted model that compresses, under a torch.func transform (grad, vmap, jacrev,
    ...): a clear error before any layer runs (its autograd Functions keep compressed tensors
    in state the transforms do not see; torch's own errors would name neither ACT nor a way
    out). At L0 the layers run plain PyTorch, and the transforms work."""
    if torch.compiler.is_compiling():  # no graph break for the check
        return
    if transforms_active() and _compresses(module):
        raise RuntimeError(
            f"actcore: the converted {type(module).__name__} cannot run under torch.func "
            "transforms (grad, vmap, jacrev, ...): its layers keep compressed tensors in "
            "autograd state those transforms do not see. Apply the transform to the "
            "unconverted model (convert keeps parameter names: torch.func.functional_call "
            "takes the same parameters)."
        )


@torch.compiler.disable  # (its stream's count would be a guard: a recompile every step)
def _root_pre(module: torch.nn.Module, args: Any) -> None:
    _refuse_functorch(module)
    stream = module.__dict__.get("act_rng")
    if isinstance(stream, SeedStream):
        active(stream)
        module.__dict__.setdefault("_act_rng_entry", []).append(stream.count)


@torch.compiler.disable
def _root_post(module: torch.nn.Module, args: Any, output: Any) -> None:
    stream = module.__dict__.get("act_rng")
    if isinstance(stream, SeedStream):
        release(stream)
        entries = module.__dict__.get("_act_rng_entry")
        entry = entries.pop() if entries else None
        if entry is not None and forward_raised(output):
            with stream._lock:  # a forward that raised takes no seeds from the stream
                stream.count = entry


def attach_stream(model: torch.nn.Module, seed: int | None = None) -> SeedStream:
    """Give ``model`` its stream (``model.act_rng``; kept if it has one and ``seed`` is None)."""
    stream = model.__dict__.get("act_rng")
    if not isinstance(stream, SeedStream) or seed is not None:
        stream = SeedStream(seed)
        model.act_rng = stream
    if not any(h is _root_pre for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_root_pre)
        model.register_forward_hook(_root_post, always_call=True)
    return stream
