"""``convert``: swap a model's standard layers for Q-layers, in place, keeping everything.

The swap changes each module's class to its Q-layer subclass: the module object, its
parameters (and so optimizer state), buffers, hooks and ``state_dict`` keys stay the same.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .budget.checkpointing import set_recompute
from .config import LEVELS, LevelSpec, config, level_spec
from .fewbit.convert import (
    SMOOTH_LEFT,
    fewbit_target,
    fewbit_target_of,
    is_fewbit,
    swap_activation,
)
from .layers.modules import Q_LAYERS, ConvertedLayer, QLayer, unsupported_reason
from .layers.recompute import RecomputedModule, recomputed_class
from .layers.scope import attach_scope, detach_scope, set_scope_exact
from .policies import Policy
from .policy_scheme import make_scheme, set_policy
from .rng import attach_stream
from .walker import Converter, Exclude, Left, check_exclude, is_excluded, walk

__all__ = [
    "ConversionReport",
    "Exclude",
    "QModule",
    "check_exclude",
    "convert",
    "default_fewbit_bits",
    "is_excluded",
    "q_layer_converter",
]

log = logging.getLogger("actcore")


@dataclass
class ConversionReport:
    """What :func:`convert` did: converted module names, and those left with the reason."""

    level: str
    converted: dict[str, str] = field(default_factory=dict)  # name -> Q-layer class
    left: dict[str, str] = field(default_factory=dict)  # name -> reason
    scope: str | None = None  # what compresses the rest of the forward (None: layers only)

    def __str__(self) -> str:
        lines = [f"actcore.convert at {self.level}: {len(self.converted)} converted"]
        if self.scope is not None:
            lines.append(f"  the rest of the forward: {self.scope}")
        lines += [f"  left {name or '<root>'}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


_DEFAULT = object()


def default_fewbit_bits(spec: LevelSpec) -> int | None:
    """Derivative bits of smooth activations (GELU, SiLU, tanh, ...) by default: None.

    By default a smooth activation keeps its input at the level's bits and is recomputed in
    backward, its output derived from that input (:mod:`actcore.layers.recompute`): the
    next layer, which saves the output, then stores nothing of its own. A few-bit derivative
    code (``fewbit_bits=k``, FewBit) keeps ``k`` bits and the next layer its own copy of the
    output: more bytes in total whenever the output is saved downstream (always, in MLPs
    and convolutional blocks). ``spec`` is accepted for adapters that tie it to a level.
    """
    return None


def convert(
    model: nn.Module,
    level: str | LevelSpec | None = None,
    *,
    exclude: Iterable[Exclude] = (),
    inplace: bool = True,
    fewbit_bits: int | Any | None = _DEFAULT,
    layers_only: bool = False,
    policy: str | Policy | None = None,
    seed: int | None = None,
    converters: Sequence[Converter] = (),
    **policy_options: Any,
) -> nn.Module:
    """Compress what ``model`` keeps for backward at ``level`` (default: ``config.level``).

    ``level`` is a name of :data:`actcore.config.LEVELS` (ActNN's levels, resolved by
    :func:`actcore.config.level_spec` only; :class:`actcore.Controller` has its own table).

    Standard layers become Q-layers (in place: same objects, parameters and ``state_dict``
    keys), and, unless ``layers_only``, everything else the model's forward saves goes
    through the saved-tensor hooks under the same level, scoped to the root module's
    forward (:mod:`actcore.layers.scope`): functional ops, elementwise products, inline attention.
    Functional ReLU/dropout/activations/normalizations get the Q-layers' tailored
    compressors (:mod:`actcore.layers.routing`); a tensor a Q-layer packed is not stored twice.
    Forward outputs are unchanged, bitwise.

    ``exclude`` takes module names (fnmatch patterns), module types, or predicates
    ``(name, module) -> bool``: excluded modules keep their class, and what they save stays
    as it is. Idempotent; converting again sets the new level. A layer whose configuration
    a Q-layer cannot take is left as it is, with a warning. The :class:`ConversionReport`
    is the returned model's ``act_report`` attribute (and logged).

    ``fewbit_bits`` (1..4, default None): smooth activations (GELU, SiLU, Tanh, Sigmoid,
    ELU, Mish, Softplus, Hardswish, ...) become :mod:`actcore.fewbit` modules that keep a
    ``fewbit_bits``-bit derivative index per element instead of their input; with None they
    keep their input at the level's bits, recomputed in backward, and the next layer refers
    to it (see :func:`default_fewbit_bits`).
    Threshold, Hardsigmoid, Hardshrink and Softshrink always become their few-bit forms (an
    exact 1-bit mask).

    ``policy`` (``"fixed"``, ``"auto"``, ``"acgc"`` or an :mod:`actcore.policies` Policy, with
    its ``policy_options`` such as ``error_bound=0.1``) picks the bits of each tensor a
    Q-layer saves (key ``"<module name>:<role>"``) instead of the level's bits (and of L3's
    adaptive bits); the level still says which roles are compressed and whether to swap.
    The model's ``act_policy`` (a :class:`actcore.policy_scheme.PolicyScheme`) then offers
    ``iterate(backprop)`` and ``state_dict()`` as :class:`actcore.Controller` does.

    ``converters`` (for adapters): tried before the Q-layer swap on every module that is not
    excluded (see :func:`actcore.walker.walk`).

    ``seed``: of the model's own stream of rounding seeds (``model.act_rng``, see
    :mod:`actcore.rng`; default: from torch's generator state now, without drawing from it).
    :func:`actcore.resume.state_dict` gathers it with the bit plans for a bit-exact resume.
    """
    _check_model(model)
    spec = config.spec if level is None else level_spec(level)
    scheme = make_scheme(spec, policy, policy_options)
    if fewbit_bits is _DEFAULT:
        fewbit_bits = default_fewbit_bits(spec)
    if fewbit_bits is not None:
        from .fewbit.tables import check_bits

        check_bits(fewbit_bits, "fewbit_bits")
    if spec.expandable_segments:
        from .allocator import enable_expandable_segments

        enable_expandable_segments()
    if not inplace:
        model = copy.deepcopy(model)
    report = ConversionReport(spec.name)

    def on_excluded(name: str, module: nn.Module) -> None:
        if isinstance(module, QLayer):  # converted before: keeps its tensors as torch does
            module.act_spec = LEVELS["L0"]

    done = walk(
        model,
        [*converters, q_layer_converter(spec, fewbit_bits, scope=not layers_only)],
        exclude=exclude,
        on_excluded=on_excluded,
    )
    report.converted, report.left = done.converted, done.left
    attach_stream(model, seed)
    _set_adaptive(model, spec.adaptive and scheme is None)
    set_policy(model, scheme)
    if layers_only or not spec.packs:
        detach_scope(model)
    else:
        attach_scope(model, spec, fewbit_bits=fewbit_bits, excluded=list(done.excluded.values()))
    report.scope = None if layers_only else repr(getattr(model, "act_scope", None))
    in_scope = not layers_only and spec.packs
    for module in model.modules():
        if isinstance(module, ConvertedLayer):
            module.act_in_scope = in_scope
    plan = model.__dict__.pop("act_memory_plan", None)  # every Q-layer at `level` again
    if plan is not None:  # and no block recomputed or kept exact by a plan
        for name, module in model.named_modules():
            if name in plan.recompute:
                set_recompute(module, False)
            set_scope_exact(module, None)
    model.act_report = report
    log.info("%s", report)
    return model


def q_layer_converter(spec: LevelSpec, fewbit_bits: int | None, scope: bool = True) -> Converter:
    """The converter of :func:`convert`: standard layers to Q-layers at ``spec`` (and the
    registered ones, :func:`actcore.layers.register_q_layer`), activations to their few-bit
    forms (:func:`actcore.fewbit.convert.swap_activation`) when ``fewbit_bits`` is given.
    With the ``scope``, torch's smooth activations need nothing: the scope routes the
    functional they call."""

    def convert_one(name: str, module: nn.Module) -> str | Left | None:
        if isinstance(module, RecomputedModule) and fewbit_bits is not None:
            source = module.act_source_class
            if fewbit_target_of(source)[0] is not None:
                module.__class__ = source  # converted again with few-bit codes
        if isinstance(module, QLayer):
            module.act_spec, module.act_name = spec, name  # errors name the layer
            return type(module).__name__
        if fewbit_target(module)[0] is not None or is_fewbit(module):
            new = swap_activation(module, fewbit_bits)
            if new is not None:
                return new
        target = Q_LAYERS.get(type(module)) or recomputed_class(module)
        if target is None and fewbit_target(module)[0] is not None:
            # torch's smooth activations call their functional, which the scope routes
            return None if scope else Left(SMOOTH_LEFT)
        if target is None:
            base = next((b for b in Q_LAYERS if isinstance(module, b)), None)
            if base is None:
                return None
            return Left(f"a subclass of {base.__name__} with its own behaviour")
        reason = unsupported_reason(module)
        if reason is not None:
            return Left(reason, warn=True)
        module.__class__ = target
        module.act_spec, module.act_name = spec, name
        return target.__name__

    return convert_one


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"actcore.convert takes a torch.nn.Module, got {type(model).__name__}")
    import torch.jit

    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"actcore.convert cannot change a scripted or traced model ({type(model).__name__}): "
            "its forward is compiled TorchScript that ignores Q-layers and saved-tensor hooks; "
            "convert the Python model first, then script or trace it if you must"
        )


def _set_adaptive(model: nn.Module, adaptive: bool) -> None:
    """Attach (or keep) one :class:`AdaptiveBits` at adaptive levels, else detach it."""
    from .adaptive import AdaptiveBits

    scheme = getattr(model, "act_adaptive", None)
    if adaptive:
        if not isinstance(scheme, AdaptiveBits):
            scheme = AdaptiveBits()
        model.act_adaptive = scheme.attach(model)
    elif scheme is not None:
        AdaptiveBits.detach(model)
        model.act_adaptive = None


def QModule(model: nn.Module) -> nn.Module:
    """ActNN's entry point: ``convert(model)`` at the level set by ``set_optimization_level``."""
    return convert(model)
