"""``act_pyg.convert``: compress what a PyG model keeps for backward, in place."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn
from torch_geometric.nn import MessagePassing

import actcore
from actcore.extend import Exclude, LevelSpec, check_bits, level_spec

from .convs import CONVERTED, QMessagePassing, unsupported_reason

log = logging.getLogger("act_pyg")


@dataclass
class ConversionReport(actcore.ConversionReport):
    """What :func:`convert` did.

    ``converted``: module name -> new class (convs and actcore's Q-layers); ``left``: module
    name -> why it kept its class; ``hooks``: message-passing modules that keep their class
    (name -> class and reason), whose saved tensors the model's scope compresses (the
    saved-tensor hooks and functional routing of :mod:`actcore.layers.scope`); ``scope``:
    that scope.
    """

    hooks: dict[str, str] = field(default_factory=dict)
    random_projection: float | None = None

    def __str__(self) -> str:
        rp = (
            ""
            if self.random_projection is None
            else f", random projection {self.random_projection}"
        )
        lines = [f"act_pyg.convert at {self.level}{rp}: {len(self.converted)} converted"]
        if self.scope is not None:
            lines.append(f"  the rest of the forward: {self.scope}")
        lines += [f"  converted {name or '<root>'}: {cls}" for name, cls in self.converted.items()]
        lines += [f"  saved-tensor hooks {name}: {why}" for name, why in self.hooks.items()]
        lines += [f"  left {name or '<root>'}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


def _check_projection(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"random_projection must be a float in (0, 1] or None, got {value!r}")
    if not (0 < value <= 1) or math.isnan(value):
        raise ValueError(
            f"random_projection is the kept fraction of the features, in (0, 1]; got {value}"
        )
    return float(value)


def convert(
    gnn: nn.Module,
    level: str | LevelSpec = "L3",
    *,
    random_projection: float | None = None,
    attention_bits: int | None = None,
    exclude: Iterable[Exclude] = (),
    fewbit_bits: int | None = None,
) -> nn.Module:
    """Make ``gnn`` keep compressed activations for backward, in place; returns ``gnn``.

    * GCNConv, SAGEConv, GATConv and GINConv become :class:`QGCNConv`, :class:`QSAGEConv`,
      :class:`QGATConv` and :class:`QGINConv` (same object, parameters and ``state_dict``
      keys, same output);
    * Linear, ReLU, Dropout, BatchNorm1d, LayerNorm... become actcore's Q-layers
      (:func:`actcore.convert`), inside other message-passing layers too (GINConv's MLP);
    * everything else the forward saves (other message-passing layers, those whose options
      the converted classes do not cover, functional ``F.relu`` / ``F.elu`` /
      ``F.dropout`` between the convs) is compressed by the model's scope, the
      saved-tensor hooks and functional routing that :func:`actcore.convert` attaches to
      the root module's forward; what max/min aggregations compare stays exact.

    Args:
        level: an actcore level (``"L0"`` ... ``"L5"``); ValueError lists the valid ones.
        random_projection: kept fraction (0, 1] of the features of each conv's linear input,
            randomly projected (rademacher) before it is quantized (EXACT); None: off.
        attention_bits: bits of GAT's attention coefficients (None: 8 at levels that
            compress, none at L0).
        exclude: module names (fnmatch patterns), module types or ``(name, module) -> bool``
            predicates to leave alone.
        fewbit_bits: 1..4 to give smooth activation modules (``nn.ELU``, ``nn.GELU``, ...)
            a few-bit derivative code instead of their input (FewBit, as
            :func:`actcore.convert`); None (default) keeps their input at the level's bits,
            recomputed in backward.

    The :class:`ConversionReport` is ``gnn.act_report``. Converting again sets the new
    options.
    """
    if not isinstance(gnn, nn.Module):
        raise TypeError(f"convert expects an nn.Module, got {type(gnn).__name__}")
    spec = level_spec(level)
    projection = _check_projection(random_projection)
    if attention_bits is not None:
        check_bits(attention_bits, "attention_bits")
    report = ConversionReport(spec.name, random_projection=projection)

    def convert_message_passing(name: str, module: nn.Module) -> str | None:
        if not isinstance(module, MessagePassing):
            return None
        if isinstance(module, QMessagePassing):
            target = type(module)
        else:
            target = CONVERTED.get(type(module))
            if target is None:
                known = next((c for c in CONVERTED if isinstance(module, c)), None)
                why = (
                    f"a subclass of {known.__name__} with its own behaviour"
                    if known is not None
                    else f"{type(module).__name__} has no converted version"
                )
                report.hooks[name] = f"{type(module).__name__} ({why})"
                return None  # the scope compresses what it saves
            reason = unsupported_reason(module)
            if reason is not None:
                report.hooks[name] = f"{type(module).__name__} ({reason})"
                return None
            module.__class__ = target
        module.act_spec = spec
        module.act_projection = projection
        module.act_attention_bits = attention_bits
        return target.__name__

    actcore.convert(
        gnn,
        spec,
        exclude=exclude,
        converters=[convert_message_passing],
        fewbit_bits=fewbit_bits,
    )
    core = gnn.act_report
    report.converted, report.left, report.scope = core.converted, core.left, core.scope
    gnn.act_report = report
    log.info("%s", report)
    return gnn
