"""Adaptive bits (level L3): per-sample and per-layer bits under an average-bits budget.

Every ``interval`` steps, :meth:`AdaptiveBits.replan` gives each layer and each rank of
sample in a batch the bits that minimise the predicted gradient noise ``sum V_li(b_li)``
(``V_li(b) = s_l w_li / (4 (2^b - 1)^2)``: the layer's sensitivity times the sample's range
weight) under the budget of stored bits. Statistics are taken only in a window of steps
before each replan, on the device (no host synchronisation outside ``replan``); a value
that is not finite is skipped and counted; :meth:`AdaptiveBits.state_dict` resumes a run
exactly. The model, the allocation, the per-dataset-sample option and the fault rules are
in docs/ARCHITECTURE.md ("Adaptive bits").

This module is the scheme; its parts are ``stats`` (a layer's statistics and their
averages), ``recording`` (the statistics tap on what it packs), ``plan`` (the plan from
the statistics), ``samples`` (the per-dataset-sample tables) and ``state``
(checking a saved state).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..compressors import (
    Compressor,
    PerSampleQuantize,
    Quantize,
    ScoredPerSampleQuantize,
    ZeroValue,
    sample_range_weights,
)
from ..config import config
from ..layers.roles import CONV, NORM, ROW_NORM, batch_norm_bits, role_bits
from ..layers.stash import layer_spec, records
from ..rng import forward_raised
from .plan import (
    allocation_items,
    plan_average_bits,
    plan_prior_bits,
    plan_variance,
    rank_counts,
    ranked_plans,
)
from .recording import recording
from .samples import batch_sample_scale, checked_index, write_norms
from .state import DEFAULT_WINDOW, STATE_FIELDS, check_same_layers, checked_state, layer_state
from .stats import LayerStats, finite_emas, gradient_coupling, host_emas, squared_norm

__all__ = ["AdaptiveBits", "ScoredPerSampleQuantize"]

_PLANNED_BY = "adaptive bits of"  # stash record: the layer whose plan packs the tensor

log = logging.getLogger("actcore")


def _reads_tokens(layer: Any) -> bool:
    """A linear layer (features along the last dim of its input)."""
    return isinstance(layer, nn.Linear)


def _merged(counts: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """``counts`` (most bits first) with runs of equal bits joined."""
    out: list[tuple[int, int]] = []
    for bits, count in counts:
        if out and out[-1][0] == bits:
            out[-1] = (bits, out[-1][1] + count)
        else:
            out.append((bits, count))
    return tuple(out)


class AdaptiveBits:
    """Per-sample / per-layer bit allocation for Q-layers (the ``act_scheme`` hook).

    ``AdaptiveBits(model, budget=2.0)`` attaches itself to every Q-layer of ``model`` that
    saves conv/linear or normalization inputs; ``convert`` does so at levels with
    ``adaptive`` (L3, L3.1, L4, L5), keeping it as ``model.act_adaptive``.

    Opt-in per-dataset-sample gradients: call :meth:`set_sample_index` with each batch's
    dataset indices before its forward. ``num_samples`` fixes the tables' size (else they
    grow to the largest index seen); ``sample_momentum`` averages a sample's norms over
    visits (0: keep the latest).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        budget: float = 2.0,
        *,
        interval: int = 20,
        momentum: float = 0.9,
        min_bits: int = 1,
        max_bits: int = 8,
        num_samples: int | None = None,
        sample_momentum: float = 0.0,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if not 1 <= min_bits <= budget <= max_bits <= 8:
            raise ValueError(
                f"need 1 <= min_bits <= budget <= max_bits <= 8, got "
                f"{min_bits}, {budget}, {max_bits}"
            )
        if interval < 1:
            raise ValueError(f"interval must be a positive int, got {interval}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be a positive int or None, got {num_samples}")
        if not 0.0 <= sample_momentum < 1.0:
            raise ValueError(f"sample_momentum must be in [0, 1), got {sample_momentum}")
        self.num_samples, self.sample_momentum = num_samples, float(sample_momentum)
        self._index: torch.Tensor | None = None  # the batch's dataset indices (host or device)
        self._index_on: dict[torch.device, torch.Tensor] = {}  # _index on each device
        self._index_end = 0  # 1 + the largest index set so far
        self.budget, self.interval, self.momentum = float(budget), interval, momentum
        self.window = window
        self.min_bits, self.max_bits = min_bits, max_bits
        self.steps = 0
        self.layers: dict[str, LayerStats] = {}
        self.skipped = 0  # statistic updates left out for non-finite values (at last replan)
        # the same, counted on the device as updates taken, against the updates tried
        self._taken: dict[torch.device, torch.Tensor] = {}
        self._tried: dict[torch.device, int] = {}
        self._warned = False
        self._task: int | bool | None = None  # the backward pass whose end is awaited
        # forward statistics of the root forward under way, applied when it returns (a
        # forward that raises adds nothing); None outside a hooked root forward
        self._pending: list[tuple[LayerStats, torch.Tensor, float]] | None = None
        # sensitivities a backward took, averaged in at its end (one update for all layers)
        self._sens_pending: list[tuple[LayerStats, torch.Tensor]] = []
        # the attached layers' weight shapes: what a loaded state must have been taken on
        self._weights: dict[str, tuple[int, ...] | None] = {}
        if model is not None:
            self.attach(model)

    # --- wiring ----------------------------------------------------------------------------

    def attach(self, model: nn.Module) -> AdaptiveBits:
        """Become the ``act_scheme`` of every Q-layer of ``model`` that keeps conv/linear or
        batch-norm inputs (``act_adaptive_bits``: row norms keep the level's own bits)."""
        from ..layers.modules import QLayer

        for name, module in model.named_modules():
            if (
                isinstance(module, QLayer)
                and getattr(module, "weight", None) is not None
                and module.act_adaptive_bits
            ):
                module.act_scheme = self
                module.act_name = name
                self.layers.setdefault(name, LayerStats())
                lazy = nn.parameter.is_lazy(module.weight)  # no shape before its first forward
                self._weights[name] = None if lazy else tuple(module.weight.shape)
        model.act_adaptive = self
        if not any(h is _forward_begins for h in model._forward_pre_hooks.values()):
            model.register_forward_pre_hook(_forward_begins)
            model.register_forward_hook(_forward_ends, always_call=True)
        return self

    @staticmethod
    def detach(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(getattr(module, "act_scheme", None), AdaptiveBits):
                module.act_scheme = None

    def set_sample_index(self, index: torch.Tensor | None) -> None:
        """Dataset indices (1-D integer tensor) of the next forward's batch; None: off.

        Validating reads the values: free for a host tensor (as a DataLoader yields), one
        synchronisation for a device tensor. Without ``num_samples`` the tables grow.
        """
        self._index_on = {}
        if index is None:
            self._index = None
            return
        self._index, end = checked_index(index, self.num_samples)
        self._index_end = max(self._index_end, end)

    def _device_index(self, device: torch.device) -> torch.Tensor | None:
        """The batch's indices on ``device`` (copied once per device and batch)."""
        if self._index is None:
            return None
        cached = self._index_on.get(device)
        if cached is None:
            cached = self._index_on[device] = self._index.to(device, non_blocking=True)
        return cached

    def _sample_scale(
        self, stats: LayerStats, name: str, n: int, device: torch.device
    ) -> torch.Tensor | None:
        """``r`` of the batch's samples from the layer's table (None without an index)."""
        index = self._device_index(device)
        if index is None:
            return None
        stats.grads, scale = batch_sample_scale(
            stats.grads, index, name, n, self.num_samples, self._index_end, device
        )
        return scale

    # --- what the stash asks an act_scheme -------------------------------------------------

    def collecting(self) -> bool:
        """Whether the step now running takes statistics: every step up to the first replan,
        then the last ``window`` steps before each replan; never while a graph is traced
        (``torch.export``, ``torch.compile``), whose tensors are not a step's values."""
        if torch.compiler.is_compiling():
            return False
        return (
            self.steps < self.interval or self.steps % self.interval >= self.interval - self.window
        )

    def compressor(
        self, layer: Any, role: str, x: torch.Tensor, bits: int, mask: torch.Tensor | None
    ) -> Compressor | None:
        """The compressor for ``x`` under the current plan (``bits``: before any plan)."""
        name = getattr(layer, "act_name", None)
        if name is None or x.dim() == 0 or x.shape[0] == 0 or role not in (CONV, NORM):
            return None  # (row norms, activations: the level's own bits)
        stats = self.layers.setdefault(name, LayerStats())
        stats.last_step = self.steps
        # the first layer asked for x packs it; later ones reuse that packing (stored once)
        owner = records().setdefault(x).setdefault(_PLANNED_BY, name)
        stats.shares = None if owner == name else owner
        gs = config.group_size
        if stats.shares is not None and _reads_tokens(layer):
            self.layers.setdefault(owner, LayerStats()).readers.add(name)
        stats.pinned = False
        if stats.shares is None and stats.readers and _reads_tokens(layer) and mask is None:
            shared = role_bits(layer_spec(layer), ROW_NORM)
            stats.pinned = shared is not None and shared > bits
            if stats.pinned:  # a hidden state several linears read: row-norm bits, no plan
                return Quantize(shared, gs, per_sample=True, stochastic=config.stochastic)
        n = x.shape[0]
        collect = self.collecting()
        bits = self.prior_bits(layer, bits)
        with torch.no_grad():  # (keeps the layer's table of sample gradients, when opted in)
            scale = self._sample_scale(stats, name, n, x.device)
        if mask is not None:
            stats.zero_value = True
            q = Quantize(self._layer_bits(stats, bits), gs, per_sample=False)
            zero_value = ZeroValue(mask, q)
            return recording(zero_value, self, stats, n, 0.0) if collect else zero_value
        stats.zero_value = False
        elems = float(x[0].numel())
        counts = self._counts(stats, n, bits)
        if role == NORM:  # a batch norm's floor for its few values per channel
            floor = batch_norm_bits(x)
            counts = _merged(tuple((max(b, floor), c) for b, c in counts))
        if len(counts) == 1:  # one width for every sample: nothing to rank
            plain = Quantize(counts[0][0], gs, per_sample=True, stochastic=config.stochastic)
            return recording(plain, self, stats, n, elems, scale) if collect else plain
        with torch.no_grad():
            weights = sample_range_weights(x, gs)
            if scale is not None:
                weights = weights * scale
            if collect:
                self._take(stats, weights.sort(descending=True).values, elems)
        if scale is not None:
            return ScoredPerSampleQuantize(counts, gs, config.stochastic, scores=weights)
        return PerSampleQuantize(counts, gs, config.stochastic, weights=weights)

    def _take(self, stats: LayerStats, profile: torch.Tensor, elems: float) -> None:
        """Average a step's range-weight profile and elements per sample into ``stats`` (once
        the root forward returns, when it runs under the model's hooks)."""
        if self._pending is not None:
            self._pending.append((stats, profile, elems))
            return
        self._apply([(stats, profile, elems)])

    def _apply(self, entries: list[tuple[LayerStats, torch.Tensor, float]]) -> None:
        """Average a forward's profiles and elements per sample into their layers (together:
        a few ops for all of them; a layer's second value of the step after its first)."""
        for batch in _rounds(entries):
            found, taken = finite_emas(
                [(st.profile, st.profile_seen, profile) for st, profile, _ in batch],
                self.momentum,
            )
            for (st, _, _), (profile, seen) in zip(batch, found, strict=True):
                st.profile, st.profile_seen = profile, seen
            elems = host_emas(
                [st.elems for st, _, _ in batch], [e for _, _, e in batch], self.momentum
            )
            for (st, _, _), average in zip(batch, elems, strict=True):
                st.elems = average
            self._count_taken(taken)

    def _flush(self) -> None:
        """Average the sensitivities taken since the last flush into their layers (a layer
        that took two, called twice in a step, the second after the first)."""
        pending, self._sens_pending = self._sens_pending, []
        for batch in _rounds(pending):
            found, taken = finite_emas(
                [(st.sens, st.sens_seen, sens) for st, sens in batch], self.momentum
            )
            for (st, _), (sens, seen) in zip(batch, found, strict=True):
                st.sens, st.sens_seen = sens, seen
            self._count_taken(taken)

    def observe(
        self,
        layer: Any,
        grad: torch.Tensor,
        kernel: int,
        channel_dim: int,
        norm: bool,
        restored: torch.Tensor | None = None,
    ) -> None:
        """Update the layer's sensitivity from its output gradient (device ops only).

        ``restored``: a linear layer's input as backward restored it (positions along all
        but the last dim, as ``grad``'s), for the coupling of gradients and ranges.
        """
        name = getattr(layer, "act_name", None)
        if name is None or grad.dim() < 2 or grad.numel() == 0:
            return
        stats = self.layers.setdefault(name, LayerStats())
        stats.norm = norm
        self._note_backward()
        index, table = self._device_index(grad.device), stats.grads
        n = grad.shape[0]
        per_sample_table = (
            index is not None
            and table is not None
            and index.shape[0] == n
            and table.device == grad.device
        )
        collect = self.collecting()
        if not (collect or per_sample_table):
            return
        per_sample = grad.numel() // n
        positions = max(1, per_sample // grad.shape[channel_dim])
        fan = 1.0 / per_sample if norm else kernel / positions
        with torch.no_grad():
            g = grad.detach()
            if per_sample_table:  # squared norms per sample (one pass), then their sum
                norms = squared_norm(g.reshape(n, -1), dim=1)
                total = norms.sum()
            else:
                total = squared_norm(g)
            if collect:
                sens = total * (fan / n)
                if restored is not None and channel_dim == -1:
                    sens = sens * gradient_coupling(g, restored, config.group_size)
                self._sens_pending.append((stats, sens))  # averaged in at the end
            if per_sample_table:  # the batch's samples' squared gradient norms into the table
                assert index is not None and table is not None
                write_norms(table, index, norms, self.sample_momentum)

    # --- steps and faults -------------------------------------------------------------------

    def _note_backward(self) -> None:
        """Count the backward pass now running once, at its end (from any layer's backward)."""
        task = _graph_task()
        if task is not None and task >= 0:
            if task == self._task:
                return
            self._task = task
        elif self._task is not None:
            return
        else:
            self._task = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._task = None
        self._flush()
        self.steps += 1
        if self.steps % self.interval == 0:
            self.replan()

    def _count_taken(self, taken: list[torch.Tensor]) -> None:
        """Count updates tried and (on the device) taken, for :meth:`_read_skipped`."""
        for group in taken:
            device = group.device
            counter = self._taken.get(device)
            if counter is None:
                counter = self._taken[device] = torch.zeros((), dtype=torch.int64, device=device)
            counter.add_(group.sum())
            self._tried[device] = self._tried.get(device, 0) + group.numel()

    def _read_skipped(self) -> None:
        """Fold the device counters into :attr:`skipped` (a host read: at replans only)."""
        for device, counter in self._taken.items():
            self.skipped += self._tried.pop(device, 0) - int(counter)
            counter.zero_()
        if self.skipped and not self._warned:
            self._warned = True
            log.warning(
                "actcore adaptive bits: %d statistic update(s) left out for non-finite values "
                "(an overflowing fp16 step or a bad batch); the averages keep their last "
                "finite values (logged once)",
                self.skipped,
            )

    # --- the plan (plan.py) -----------------------------------------------------------------

    def prior_bits(self, layer: Any, bits: int) -> int:
        """Bits before any plan: the level's, and two more for depthwise-like convolutions."""
        return plan_prior_bits(layer, bits, self.budget, self.max_bits)

    def _counts(self, stats: LayerStats, n: int, bits: int) -> tuple[tuple[int, int], ...]:
        """``(bits, samples)`` for a batch of ``n``, most bits first."""
        return rank_counts(stats.plan, n, bits)

    def _layer_bits(self, stats: LayerStats, bits: int) -> int:
        return stats.plan[0] if stats.plan else bits

    def _items(self) -> list[tuple[str, int, float, float]]:
        """``(layer, rank, weight, cost)`` of every allocation unit (host values)."""
        self._flush()
        return allocation_items(self.layers, self.steps, self.window)

    def replan(self) -> None:
        """Recompute the plan from the statistics so far (reads them back: one sync)."""
        self._flush()
        self._read_skipped()
        plans = ranked_plans(self.layers, self._items(), self.budget, self.min_bits, self.max_bits)
        for name, plan in plans.items():
            self.layers[name].plan = plan

    def predicted_variance(self, plan: dict[str, list[int]] | None = None) -> float:
        """``sum V_li(b_li)`` for ``plan`` (layer -> bits by rank; default: the current)."""
        return plan_variance(self.layers, self._items(), plan)

    def average_bits(self) -> float:
        """Cost-weighted average bits of the current plan."""
        return plan_average_bits(self.layers, self._items())

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to replan as this one would."""
        self._flush()
        self._read_skipped()
        state: dict[str, Any] = {key: getattr(self, key) for key in STATE_FIELDS}
        state["layers"] = {name: layer_state(st) for name, st in self.layers.items()}
        state["weights"] = {
            name: None if shape is None else list(shape) for name, shape in self._weights.items()
        }
        return state

    def check_state(self, state: Any) -> tuple[tuple, dict[str, LayerStats]]:
        """``state``'s values, checked (types, ranges, plans) and taken on this scheme's
        layers (names and weight shapes); ValueError/TypeError/KeyError, nothing changed."""
        top, layers = checked_state(state)
        check_same_layers(state, layers, self._weights)
        return top, layers

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; checks all of it first and changes nothing on error."""
        top, layers = self.check_state(state)
        index_end = self._index_end
        for st in layers.values():
            if st.grads is not None:
                index_end = max(index_end, st.grads.shape[0])
        for key, value in zip(STATE_FIELDS, top, strict=True):
            setattr(self, key, value)
        self.layers.update(layers)
        self._index_end = index_end
        self._taken, self._tried = {}, {}
        self._sens_pending = []
        self._task = None


def _rounds(entries: list) -> list[list]:
    """``entries`` (each led by a layer's :class:`LayerStats`) split into rounds in which each
    layer appears once, in order: one update per round keeps a layer's values of a step
    entering one after the other, as they came."""
    rounds: list[list] = []
    count: dict[int, int] = {}
    for entry in entries:
        k = count.get(id(entry[0]), 0)
        count[id(entry[0])] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(entry)
    return rounds


def _graph_task() -> int | None:
    """The id of the backward pass running on this thread (-1: none; None: unknown)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


# ---- on the model: a forward that raises leaves the statistics as they were ---------------


@torch.compiler.disable
def _forward_begins(module: nn.Module, args: Any) -> None:
    scheme = module.__dict__.get("act_adaptive")
    if isinstance(scheme, AdaptiveBits) and scheme._pending is None:
        scheme._pending = []
        module.__dict__["_act_adaptive_depth"] = 0
    elif isinstance(scheme, AdaptiveBits):  # the root forward called again inside itself
        module.__dict__["_act_adaptive_depth"] = module.__dict__.get("_act_adaptive_depth", 0) + 1


@torch.compiler.disable
def _forward_ends(module: nn.Module, args: Any, output: Any) -> None:
    scheme = module.__dict__.get("act_adaptive")
    if not isinstance(scheme, AdaptiveBits) or scheme._pending is None:
        return
    depth = module.__dict__.get("_act_adaptive_depth", 0)
    if depth:
        module.__dict__["_act_adaptive_depth"] = depth - 1
        return
    pending, scheme._pending = scheme._pending, None
    if not forward_raised(output):
        scheme._apply(pending)
