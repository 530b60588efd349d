"""``PolicyScheme``: a policy of :mod:`actcore.policies` picking the bits of Q-layers.

``convert(model, level, policy="auto" | "fixed" | "acgc" | Policy, **options)`` makes one
the ``act_scheme`` of every Q-layer (and the model's ``act_policy``): the same bit plans,
sensitivity estimation and ``state_dict`` as the saved-tensor hooks route gives
:class:`actcore.Controller`. The level still says which roles are compressed and whether
they are swapped; the policy only picks their bits. The policy is built from its kind and
options alone: no level name of the hooks route is resolved here (the two routes' level
tables are separate, see :mod:`actcore.config` and :mod:`actcore.policies`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from .compressors import IDENTITY, Compressor, Quantize, SeededQuantize, Tapped, ZeroValue
from .config import LevelSpec, config
from .layers.modules import QLayer
from .policies import Policy, build_policy, check_iteration, check_modules, plan_modules
from .saved_tensors.pass_stats import record_stats

__all__ = ["PolicyScheme", "make_scheme", "set_policy"]


class PolicyScheme:
    """A policy of :mod:`actcore.policies` as the ``act_scheme`` of a converted model's
    Q-layers: the same bit plans, estimation and ``state_dict`` as with the hooks route.

    Call :meth:`iterate` once per training iteration (``backprop`` runs one forward and
    backward, no optimizer step); adaptive policies re-estimate every ``adapt_interval``
    iterations. Keys are ``"<module name>:<role>"`` (role ``conv`` or ``norm``).
    """

    def __init__(self, policy: Policy, *, group_size: int | None = None) -> None:
        self.policy = policy
        self.group_size = config.group_size if group_size is None else group_size
        self.model: nn.Module | None = None
        self.iteration = 0
        # what AdaptivePolicy.adapt sets while it estimates (same protocol as the hooks')
        self.seeds: Any = None
        self.stats: Any = None
        self._layers: list[nn.Module] = []

    def attach(self, model: nn.Module) -> PolicyScheme:
        """Become the ``act_scheme`` of every Q-layer of ``model`` (names become keys)."""
        self.detach()
        self.model = model
        for name, module in model.named_modules():
            if isinstance(module, QLayer):
                module.act_scheme = self
                module.act_name = name
                self._layers.append(module)
        return self

    def detach(self) -> None:
        for module in self._layers:
            if getattr(module, "act_scheme", None) is self:
                module.act_scheme = None
        self._layers = []
        self.model = None

    # ---- what the stash asks an act_scheme ----------------------------------------------------

    def compressor(self, layer: Any, role: str, x: Any, bits: int, mask: Any) -> Compressor | None:
        """The policy's compressor for ``x``, which ``layer`` saves in ``role``."""
        name = getattr(layer, "act_name", None)
        if name is None:
            return None
        key = f"{name}:{role}"
        chosen = self.policy.bits_for(key)
        if chosen is None:
            return IDENTITY
        per_sample = mask is None
        if self.seeds is not None:
            q: Compressor = SeededQuantize(
                chosen, self.group_size, per_sample=per_sample, seed=self.seeds.get(key, 0)
            )
        else:
            q = Quantize(chosen, self.group_size, per_sample=per_sample, stochastic=True)
        if self.stats is not None:  # estimating: the spread of what it packs is recorded
            q = Tapped(q, functools.partial(self._record, key, chosen), tag=(key,))
        return q if mask is None else ZeroValue(mask, q)

    def observe(
        self,
        layer: Any,
        grad: Any,
        kernel: int,
        channel_dim: int,
        norm: bool,
        restored: Any = None,
    ) -> None:
        """Nothing: a policy measures its sensitivities by probe passes (:meth:`iterate`),
        not from the gradients of training steps."""

    def _record(self, key: str, bits: int, x: Any, tensors: Any) -> None:
        """While estimating: ``key``'s quantization spread from what it packed."""
        if self.stats is not None:
            record_stats(self.stats, key, bits, x.numel(), tensors, self.group_size)

    # ---- iterations and state ---------------------------------------------------------------

    def iterate(self, backprop: Callable[[], Any] | None = None) -> None:
        """Once per iteration; adaptive policies re-estimate by calling ``backprop``."""
        if self.policy.wants_adapt(self.iteration):
            if backprop is None:
                raise ValueError(
                    f"policy {self.policy.name!r} adapts at iteration {self.iteration}: "
                    "iterate() needs the backprop callable"
                )
            if self.model is None:
                raise RuntimeError("this PolicyScheme is not attached to a model")
            self.policy.adapt(self, backprop)
        self.iteration += 1

    @property
    def bit_plan(self) -> dict[str, int | None]:
        return dict(getattr(self.policy, "plan", {}))

    def state_dict(self) -> dict[str, Any]:
        policy = self.policy.state_dict()
        modules = plan_modules(self.model, policy)
        return {"iteration": self.iteration, "policy": policy, "modules": modules}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"iteration", "policy"} - set(state)
        if missing:
            raise KeyError(f"PolicyScheme state lacks {sorted(missing)}")
        iteration = check_iteration(state["iteration"], "PolicyScheme")
        check_modules(self.model, state.get("modules"), "PolicyScheme state")
        self.policy.load_state_dict(state["policy"])  # checks all first, then changes
        self.iteration = iteration

    def __repr__(self) -> str:
        return f"PolicyScheme({self.policy!r}, iteration={self.iteration})"


def make_scheme(spec: LevelSpec, policy: Any, options: dict[str, Any]) -> PolicyScheme | None:
    """The :class:`PolicyScheme` of ``convert(..., policy=policy, **options)`` at ``spec``.

    ``policy``: None (no scheme: the level's own bits), a PolicyScheme, a Policy, or a kind
    of :data:`actcore.policies.POLICY_OPTIONS` whose bits (``bits``, ``avg_bits``) default to
    the level's conv/linear bits (4 without). Swapping stays the level's business (L4, L5,
    ``swap`` wrap every compressor), so the policy never swaps by itself.
    """
    if policy is None:
        if options:
            raise TypeError(f"options {sorted(options)} need a policy (fixed, auto, acgc)")
        return None
    if isinstance(policy, PolicyScheme):
        return policy
    if isinstance(policy, Policy):
        if options:
            raise TypeError(f"options {sorted(options)} cannot apply to a Policy instance")
        return PolicyScheme(policy)
    default = spec.conv_bits if spec.conv_bits is not None else 4
    return PolicyScheme(build_policy(policy, options, bits=default))


def set_policy(model: nn.Module, scheme: PolicyScheme | None) -> None:
    """Make ``scheme`` ``model``'s ``act_policy`` (detaching an earlier one); None removes it."""
    old = getattr(model, "act_policy", None)
    if isinstance(old, PolicyScheme):
        old.detach()
    if scheme is None:
        if old is not None:
            model.act_policy = None
        return
    model.act_policy = scheme.attach(model)
