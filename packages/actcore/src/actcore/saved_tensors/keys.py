"""Keys that name each save by the module that made it (``"encoder.layers.0.linear1#0:1"``).

A key is the module's name, the call of that module in this forward and the index of the
save inside that call, so a bit plan keyed by it does not depend on global forward order:
running submodules in another order, or skipping one, leaves the other modules' keys as
they were. Saves outside every module are keyed ``"<outside>:i"``, counted from the start
of the latest root forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleKeys"]


class ModuleKeys:
    """The module-scoped keys of one model's saves (forward hooks on every module)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._frames: list[list] = []  # [name, call, index of the next save in the call]
        self._calls: dict[str, int] = {}
        self._outside = 0

    def attach(self, model: nn.Module, on_new_forward: Callable[[], None]) -> None:
        """Follow ``model``'s module calls; ``on_new_forward`` runs as a new forward of the
        root (or of a part of the model) starts."""
        self.detach()
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name, on_new_forward)))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def restart_outside(self) -> None:
        """Count saves outside every module from 0 again."""
        self._outside = 0

    def next_key(self) -> str:
        """The key of the save being made now."""
        if self._frames:
            frame = self._frames[-1]
            frame[2] += 1
            return f"{frame[0]}#{frame[1]}:{frame[2] - 1}"
        self._outside += 1
        return f"<outside>:{self._outside - 1}"

    def _pre(self, name: str, on_new_forward: Callable[[], None]) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return  # keys name eager saves; compiled graphs inline their own packing
            if not self._frames:  # a new forward of the root (or of a part of the model)
                self._calls.clear()
                self._outside = 0  # saves after it (e.g. the loss) count from here
                on_new_forward()
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            self._frames.append([name, call, 0])

        return pre

    def _post(self, name: str) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            for i in range(len(self._frames) - 1, -1, -1):
                if self._frames[i][0] == name:
                    del self._frames[i:]
                    break

        return post
