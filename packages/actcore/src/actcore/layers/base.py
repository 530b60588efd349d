"""``ConvertedLayer``, what every converted layer carries; ``QLayer``, the mixin of every
Q-layer; and the configurations a Q-layer cannot take."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import LevelSpec, level_spec
from ..rng import transforms_active
from ..saved_tensors.op_mode import call_outside_modes, recomputed
from .stash import Scheme, layer_spec, needs_saving

__all__ = [
    "ConvertedLayer",
    "QLayer",
    "run_outside_compile",
    "unsupported_reason",
]


class ConvertedLayer:
    """What every converted layer (Q-layers, recomputed modules, routed functionals, the
    adapters' layers) carries for the hot path, as typed fields.

    ``act_spec``: its level, resolved once when it was converted (None: the process-wide
    level, ``actcore.config.spec``); the per-pack path reads it and never looks a name up.
    ``act_name``: its name in the model (errors and bit plans name it; ``""`` is the root,
    None a layer built directly, not by a conversion). ``act_scheme``: its bits scheme (a
    :class:`~actcore.layers.stash.Scheme`, e.g. :class:`actcore.adaptive.AdaptiveBits`),
    None for the level's fixed bits.
    ``act_level`` is the level's name, and setting it resolves a name into ``act_spec``.
    ``act_in_scope``: whether a model scope compresses around it (``convert`` without
    ``layers_only``), whose hooks then pack its saves inside compiled graphs.
    """

    act_spec: LevelSpec | None = None
    act_name: str | None = None
    act_scheme: Scheme | None = None
    act_in_scope: bool = False  # inside a converted model's scope (see QLayer.__call__)

    @property
    def act_level(self) -> str | None:
        return None if self.act_spec is None else self.act_spec.name

    @act_level.setter
    def act_level(self, level: str | LevelSpec | None) -> None:
        self.act_spec = None if level is None else level_spec(level)  # ValueError if unknown


class QLayer(ConvertedLayer):
    """Mixin of every Q-layer: its level and per-layer compression state."""

    act_adaptive_bits = True  # whether adaptive bit plans (L3) choose its bits
    # a norm whose output the layer route derives from its packed input: traced by Dynamo
    # inside a scope, in a non-reentrant checkpoint (see __call__)
    act_recompute_output = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A Q-layer is its own tailored treatment: the functional-op router of a converted
        # model's scope has nothing to do inside it (and would only add per-call overhead).
        # Traced by torch.compile inside a scope it is its plain module (``needs_saving`` is
        # False there): the scope's saved-tensor hooks, inlined into the compiled graph,
        # pack its saves. Without a scope (``layers_only``, a layer built directly) nothing
        # would, so at a level that packs it runs eagerly, compressing (a graph break).
        if torch.compiler.is_compiling():
            packs = layer_spec(self).packs
            if self.act_in_scope and packs and self.act_recompute_output:
                # a norm, whose output the layer route derives from its packed input:
                # traced in a non-reentrant checkpoint, so the compiled graph saves the
                # input once and backward recomputes the output from it, not a second,
                # separately packed copy for the products that read it; its statistics
                # (a decomposed norm's means) are saved exact, as the layer route keeps them
                return recomputed(super().__call__, *args, **kwargs)  # type: ignore[misc]
            if self.act_in_scope or not packs:
                return super().__call__(*args, **kwargs)  # type: ignore[misc]
            return run_outside_compile(super().__call__, args, kwargs)  # type: ignore[misc]
        if transforms_active():
            self._check_transformable()
        return call_outside_modes(super().__call__, args, kwargs)  # type: ignore[misc]

    def _check_transformable(self) -> None:
        """Under a torch.func transform a layer runs plain PyTorch at L0 and refuses to run
        at a level that compresses (its autograd Functions keep compressed tensors in state
        the transforms do not see)."""
        spec = layer_spec(self)
        if spec.packs:
            raise RuntimeError(
                f"actcore: {type(self).__name__} at {spec.name} cannot run under torch.func "
                "transforms (grad, vmap, jacrev, ...): it keeps compressed tensors in autograd "
                "state those transforms do not see. Run the transform at L0 or on the "
                "unconverted model."
            )

    def _compresses(self, *tensors: torch.Tensor | None) -> bool:
        return layer_spec(self).packs and needs_saving(*tensors)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return base if self.act_level is None else f"{base}, act_level={self.act_level!r}"


@torch.compiler.disable
def run_outside_compile(call: Any, args: tuple, kwargs: dict) -> Any:
    """``call`` run eagerly under torch.compile (a graph break): a converted layer's own
    compression, with its identity tables and fresh seeds, which a trace would freeze."""
    return call_outside_modes(call, args, kwargs)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a configuration of ``module`` cannot be taken by its Q-layer (None if it can)."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
        if any(t % 2 for t in totals):
            return "padding='same' with an even receptive field pads asymmetrically"
    if isinstance(module, nn.modules.pooling._MaxPoolNd) and module.return_indices:
        return "return_indices=True hands the int64 indices to the caller"
    return None
