"""Recompute a block in backward instead of keeping what its forward saves: non-reentrant
``torch.utils.checkpoint`` around the block's own ``forward``, switched on and off per
module with the module left where it is (parameter names and ``state_dict`` keys do not
change, unlike a wrapper module). The random state is replayed, so dropout draws the same
mask again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from ..memory import note_saved

__all__ = ["candidate_blocks", "inside", "is_recomputed", "recomputed_blocks", "set_recompute"]

_FLAG = "act_recompute"


class _Recomputed:
    """The instance ``forward`` of a recomputed module (picklable, copied with it).

    The random state the recompute replays is kept here rather than inside
    ``torch.utils.checkpoint`` (``preserve_rng_state=False``, the same replay), so that the
    memory trackers see it: 5 KiB of CPU generator state per block, part of what the
    block keeps for backward. So are the tensors the checkpoint holds by reference rather
    than saves: those in keyword arguments and inside containers among the positional ones
    (a decoder layer's ``position_embeddings=(cos, sin)``); only top-level positional
    tensors go through the saved-tensor hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = type(module).forward
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        cpu_state = torch.get_rng_state()
        devices, states = get_device_states(*args)
        held = [a for a in args if not isinstance(a, torch.Tensor)]
        note_saved([cpu_state, *states, held, kwargs])
        calls = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself
                return forward(module, *a, **k)
            with torch.random.fork_rng(devices=devices):  # a recompute: the same draws
                torch.set_rng_state(cpu_state)
                set_device_states(devices, states)
                return forward(module, *a, **k)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def set_recompute(module: nn.Module, on: bool) -> None:
    """Recompute ``module``'s forward in backward (``on``) or not. ValueError for a module
    that already has a forward of its own set on the instance (another library's patch)."""
    if on:
        if is_recomputed(module):
            return
        if "forward" in module.__dict__:
            raise ValueError(
                f"cannot recompute this {type(module).__name__}: its instance already has its "
                "own forward (set by another tool), which recomputing would hide"
            )
        module.__dict__["forward"] = _Recomputed(module)
        module.__dict__[_FLAG] = True
    elif module.__dict__.pop(_FLAG, False):
        module.__dict__.pop("forward", None)


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`set_recompute` switched ``module`` on."""
    return bool(module.__dict__.get(_FLAG, False))


def recomputed_blocks(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` that are recomputed."""
    return [name for name, m in model.named_modules() if is_recomputed(m)]


def candidate_blocks(model: nn.Module) -> list[str]:
    """The blocks of ``model`` worth recomputing one by one: the children of each innermost
    container (``nn.Sequential`` or ``nn.ModuleList``) whose children are all composite
    modules. ResNet's bottlenecks, a decoder's layers, ViT's encoder layers, MobileNet's
    and EfficientNet's stages; none for a plain stack of layers."""
    stages = []
    for name, module in model.named_modules():
        kids = list(module.children())
        composite = all(any(True for _ in kid.children()) for kid in kids)
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and kids and composite:
            stages.append(name)
    blocks = []
    for name in stages:
        prefix = f"{name}." if name else ""
        if any(other != name and other.startswith(prefix) for other in stages):
            continue  # a stage of stages: its inner stages' blocks instead
        blocks += [prefix + key for key, _ in model.get_submodule(name).named_children()]
    return blocks


def inside(name: str, blocks: Sequence[str]) -> bool:
    """Whether module ``name`` is one of ``blocks`` or inside one."""
    return any(name == b or name.startswith(b + ".") for b in blocks)
