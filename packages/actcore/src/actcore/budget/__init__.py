"""Fitting a memory budget: the level of each Q-layer, and where that is not enough the
blocks to recompute, chosen so a forward keeps at most ``budget`` bytes for backward.

:func:`fit_budget` measures what the converted model keeps (:func:`actcore.memory.track`,
one forward of the example inputs) with every Q-layer at each candidate level, from exact
(``L0``) to the coarsest, and (``order="error"``, the default) the gradient error each run
of Q-layers adds at each level (:mod:`.errors`, probe steps). Those per-module tables
order the moves "one Q-layer to a coarser level" by the bytes they save per unit of
gradient error (``order="bytes"``: by the bytes alone, one level at a time): a path of
configurations from all exact to all coarsest. Bytes are not quite additive across modules
(a tensor two layers share is kept once when they pack it alike, a ReLU's mask serves the
next layer at ``L3``), so the path is measured, not predicted: a bisection finds its first
configuration that fits, a few forwards in all; then the layers that the last step made
coarser than the budget needs go one level finer again while the tables say they fit
(the longest run of those moves that fits when measured). The plan is that
configuration, measured.

The planning forwards draw their random numbers (dropout) from one fixed seed, so every
configuration is measured on the same draw, and leave no trace: buffers (batch-norm
statistics) and torch's random state are restored after them. What a zero-value level
keeps depends on the data (a ReLU output's nonzeros): other inputs or dropout draws keep a
little more or less than the plan measured.

Where every Q-layer at the coarsest level still keeps too much, blocks are recomputed in
backward (:mod:`.checkpointing`: non-reentrant checkpointing in place, dropout replayed):
the fewest that fit, those that keep the most first (a bisection over that order), the
Q-layers inside them exact (what they save is recomputed), the levels of the others
planned as above in what is left. A recomputed block still keeps its input exact, so on a
network whose Q-layers already compress well, recomputing saves less than the coarsest
level did; it is the way past that level, not a first choice.

A budget bounds the bytes kept (``bound="kept"``, the default of :func:`fit_budget`) or
a whole training step's peak above its start (``bound="peak"``, :mod:`.peak`): kept bytes
plus the backward's temporaries, which grow as more layers decompress what they kept (on
an H200, ResNet-50 batch 128 at bf16 peaked 2-3% above what it kept at budgets down to a
third of the exact bytes, and 1.8x above at the least L3 keeps). The plan is searched by
bytes kept, its step measured, and searched again with the excess taken off.

:func:`max_batch` and :func:`max_seq` find the largest batch or sequence length whose
activations fit a budget at the least any plan keeps (doubling, then a bisection), and
plan it.

``order="time"`` (:mod:`.fastest`) chooses the levels, the recomputed blocks and, per
block, whether the model scope compresses what no Q-layer saves, all together: a knapsack
(:mod:`.knapsack`) over the step time each choice adds (:mod:`.costs`, measured) and the
gradient error it adds (:mod:`.errors`), weighted by ``error_weight``; recompute is then
one choice among the others.

This is a slice of the budget planner: offload and per-tensor choices are not planned yet.
The plan stays on the model and :mod:`actcore.resume` saves and restores it.
"""

from __future__ import annotations

from .checkpointing import candidate_blocks, recomputed_blocks, set_recompute
from .costs import forget_times
from .errors import forget_errors
from .peak import step_peak
from .plan import BOUNDS, ORDERS, MemoryPlan, budget_share, parse_bytes
from .search import fit_budget
from .sizes import default_budget, max_batch, max_seq

__all__ = [
    "BOUNDS",
    "ORDERS",
    "MemoryPlan",
    "budget_share",
    "candidate_blocks",
    "default_budget",
    "fit_budget",
    "forget_errors",
    "forget_times",
    "max_batch",
    "max_seq",
    "parse_bytes",
    "recomputed_blocks",
    "set_recompute",
    "step_peak",
]
