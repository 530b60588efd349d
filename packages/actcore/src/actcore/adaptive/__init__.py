"""Adaptive bits (L3): per-sample and per-layer bit allocation under a budget.

:class:`AdaptiveBits` (``scheme.py``) is the scheme a converted model's layers consult; its
parts are ``stats.py`` (a layer's statistics and their averages), ``recording.py`` (the
statistics tap on what a layer packs), ``plan.py`` (the plan from the statistics, through
the one bit allocator of ``bit_allocation.py``, which :mod:`actcore.policies` uses too),
``samples.py`` (the per-dataset-sample tables) and ``state.py`` (checking a saved state).
"""

from __future__ import annotations

from .scheme import AdaptiveBits, ScoredPerSampleQuantize
from .stats import LayerStats

__all__ = ["AdaptiveBits", "LayerStats", "ScoredPerSampleQuantize"]
