"""Policies: how many bits each saved tensor gets (shared by both front doors).

* :class:`FixedBits`: the same bits for every tensor (``G1``, ``G1.1``, ``G1.2``: GACT's L1, L1.1, L1.2), or none (``G0``).
* :class:`AutoPrecision`: per-tensor bits from measured sensitivity under an average-bits
  budget (``G2``, ``G2.1``, ``G2.2``, ``G3``: GACT's L2, L2.1, L2.2, L3).
* :class:`ACGC`: per-tensor bits so that the predicted relative gradient error stays under a
  bound (AC-GC).

The hooks route's levels are in :mod:`actcore.config` (``HOOK_LEVELS``), the base and fixed
policies in :mod:`actcore.policies.base`, the estimated ones in
:mod:`actcore.policies.sensitivity`; this module builds a policy from a level or a kind.
"""

from __future__ import annotations

from typing import Any

from ..config import HOOK_LEVELS, HookLevel, hook_level
from .base import FixedBits, Policy, check_iteration, check_modules, plan_modules
from .sensitivity import ACGC, AdaptivePolicy, AutoPrecision

__all__ = [
    "ACGC",
    "HOOK_LEVELS",
    "POLICY_OPTIONS",
    "AdaptivePolicy",
    "AutoPrecision",
    "FixedBits",
    "HookLevel",
    "Policy",
    "as_policy",
    "build_policy",
    "check_iteration",
    "check_modules",
    "hook_level",
    "make_policy",
    "plan_modules",
]

_ADAPTIVE_KEYS = ("adapt_interval", "min_bits", "max_bits", "max_passes", "probe_bits", "swap")
POLICY_OPTIONS = {
    "fixed": ("bits", "swap"),
    "auto": ("avg_bits", *_ADAPTIVE_KEYS),
    "acgc": ("error_bound", "safety", *_ADAPTIVE_KEYS),
}


def make_policy(level: str | HookLevel = "G2", policy: Any = None, **overrides: Any) -> Policy:
    """The policy of ``level``, or of ``policy`` (``"fixed"``, ``"auto"``, ``"acgc"`` or a
    :class:`Policy`), with ``overrides`` (e.g. ``bits=3``, ``adapt_interval=100``)."""
    if isinstance(policy, Policy):
        if overrides:
            raise TypeError(f"options {sorted(overrides)} cannot apply to a Policy instance")
        return policy
    lv = hook_level(level)
    kind = policy if policy is not None else ("auto" if lv.auto else "fixed")
    return build_policy(kind, overrides, bits=lv.bits, swap=lv.swap)


def build_policy(
    kind: Any, options: dict[str, Any], *, bits: int | None, swap: bool = False
) -> Policy:
    """A policy of ``kind`` (a key of :data:`POLICY_OPTIONS`) with ``options``, checked;
    ``bits`` is the default of ``bits`` (fixed) and ``avg_bits`` (auto; 4 when None)."""
    if kind not in POLICY_OPTIONS:
        raise ValueError(f"unknown policy {kind!r}; valid: {', '.join(POLICY_OPTIONS)} or a Policy")
    allowed = POLICY_OPTIONS[kind]
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise TypeError(f"unknown option(s) {bad} for policy {kind!r}; allowed: {list(allowed)}")
    opts = {"swap": swap, **options}
    if kind == "fixed":
        return FixedBits(opts.pop("bits", bits), **opts)
    if kind == "auto":
        return AutoPrecision(opts.pop("avg_bits", bits or 4), **opts)
    return ACGC(**opts)


def as_policy(policy: Any) -> Policy:
    """A :class:`Policy` from a Policy, a level name or a number of bits."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICY_OPTIONS:
        return make_policy(policy=policy)
    if isinstance(policy, (str, HookLevel)):
        return make_policy(policy)
    if isinstance(policy, int) and not isinstance(policy, bool):
        return FixedBits(policy)
    if policy is None:
        return FixedBits(None)
    raise TypeError(
        f"policy must be a level name ({', '.join(HOOK_LEVELS)}), bits 1..8, None or a "
        f"Policy, got {policy!r}"
    )
