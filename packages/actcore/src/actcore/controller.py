"""``Controller``: GACT's front door, saved-tensor compression for any model.

::

    controller = actcore.Controller(model, level="G2")
    controller.install_hook()
    for x, y in loader:
        def backprop():
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss
        backprop()
        controller.iterate(backprop)   # once per iteration; adaptive policies re-estimate here
        optimizer.step()
    controller.uninstall_hook()

``backprop`` must run one forward and backward and must not step the optimizer: at adapt
iterations the controller calls it a few extra times (gradients and RNG state are restored
afterwards, so the caller's ``.grad`` and random stream are unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .fewbit.convert import swap_activation
from .fewbit.tables import check_bits
from .policies import (
    HookLevel,
    Policy,
    check_iteration,
    check_modules,
    hook_level,
    make_policy,
    plan_modules,
)
from .rng import SeedStream
from .saved_tensors.hooks import SavedTensorHooks, scales_from_state

__all__ = ["Controller", "swap_activations"]

_HOOK_OPTIONS = ("min_numel", "group_size", "exact_ops")


def swap_activations(model: nn.Module, bits: int | None) -> dict[str, str]:
    """Swap ``model``'s plain torch activations for few-bit ones at ``bits`` (see
    :func:`actcore.fewbit.convert.swap_activation`); returns ``{name: new class name}``."""
    if bits is not None:
        check_bits(bits)
    swapped = {}
    for name, module in model.named_modules():
        new = swap_activation(module, bits)
        if new is not None:
            swapped[name] = new
    return swapped


class Controller:
    """Compress what autograd saves in ``model``'s forward, as ``level``/``policy`` decide.

    Args:
        model: the model (its parameters/buffers are never compressed; its module names key
            the per-tensor bit plan).
        level: one of :data:`actcore.config.HOOK_LEVELS` (``"G0"``..``"G3"``: GACT's
            ``L0``..``L3``; ``convert``'s level names are refused here).
        policy: ``None`` (the level's), ``"fixed"``, ``"auto"``, ``"acgc"`` or a
            :class:`~actcore.policies.Policy`.
        fewbit_bits: 1..4, or None. When given, the model's smooth activations (GELU, SiLU,
            Tanh, ...) are swapped, in place and now, for :mod:`actcore.fewbit` modules that
            save a packed ``fewbit_bits``-bit derivative index (an integer tensor, which the
            hooks keep as it is) instead of their input; Threshold/Hardsigmoid/shrinks get
            an exact 1-bit mask. Forward outputs do not change. ``fewbit_swapped`` lists them.
        seed: of the controller's own stream of rounding seeds (:mod:`actcore.rng`; default:
            from torch's generator state now, without drawing from it). It is in
            :meth:`state_dict`, so a resumed run rounds as the uninterrupted one.
        **overrides: ``min_numel``, ``group_size``, ``exact_ops`` (see
            :func:`actcore.compress_saved_tensors`), and the policy's options (``bits``,
            ``avg_bits``, ``adapt_interval``, ``error_bound``, ``max_passes``, ``swap``, ...).

    The :class:`~actcore.saved_tensors.hooks.SavedTensorHooks` it installs is its
    ``saved_tensor_hooks`` attribute.
    """

    def __init__(
        self,
        model: nn.Module,
        level: str | HookLevel = "G2",
        *,
        policy: str | Policy | None = None,
        fewbit_bits: int | None = None,
        seed: int | None = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Controller needs an nn.Module, got {type(model).__name__}")
        self.level = hook_level(level)
        self.fewbit_swapped = {} if fewbit_bits is None else swap_activations(model, fewbit_bits)
        hook_options = {k: overrides.pop(k) for k in _HOOK_OPTIONS if k in overrides}
        self.policy = make_policy(self.level, policy, **overrides)
        self.model = model
        self.saved_tensor_hooks = SavedTensorHooks(self.policy, **hook_options)
        self.rng = SeedStream(seed)
        self.saved_tensor_hooks.stream = self.rng
        self.iteration = 0
        self._installed = False

    # ---- hooks ------------------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return self._installed

    def install_hook(self) -> None:
        """Start compressing saved tensors (on this thread) until :meth:`uninstall_hook`."""
        if self._installed:
            return
        self.saved_tensor_hooks.attach(self.model)
        self.saved_tensor_hooks.__enter__()
        self._installed = True

    def uninstall_hook(self) -> None:
        """Stop compressing; graphs built meanwhile still backpropagate correctly."""
        if not self._installed:
            return
        self.saved_tensor_hooks.__exit__(None, None, None)
        self.saved_tensor_hooks.detach_model()
        self._installed = False

    def __enter__(self) -> Controller:
        self.install_hook()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall_hook()

    # ---- iterations -------------------------------------------------------------------------

    def iterate(self, backprop: Callable[[], Any] | None = None) -> None:
        """Call once per iteration. Adaptive policies re-estimate every ``adapt_interval``
        iterations by calling ``backprop`` (forward + backward, no optimizer step)."""
        self.saved_tensor_hooks.refresh_params()
        if self.policy.wants_adapt(self.iteration):
            if backprop is None:
                raise ValueError(
                    f"policy {self.policy.name!r} adapts at iteration {self.iteration}: "
                    "iterate() needs the backprop callable"
                )
            was_installed = self._installed
            if not was_installed:
                self.install_hook()
            try:
                self.policy.adapt(self.saved_tensor_hooks, backprop)
            finally:
                if not was_installed:
                    self.uninstall_hook()
        self.iteration += 1

    @property
    def bit_plan(self) -> dict[str, int | None]:
        """Bits per saved-tensor key decided so far (empty for fixed policies)."""
        return dict(getattr(self.policy, "plan", {}))

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "level": self.level.name,
            "iteration": self.iteration,
            "policy": (policy := self.policy.state_dict()),
            "modules": plan_modules(self.model, policy),
            "rng": self.rng.state_dict(),
            "channel_scales": self.saved_tensor_hooks.scales_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: same iteration count and the same bit plan."""
        if not isinstance(state, dict):
            raise TypeError(f"Controller state must be a dict, got {type(state).__name__}")
        missing = {"iteration", "policy"} - set(state)
        if missing:
            raise KeyError(f"Controller state lacks {sorted(missing)}")
        iteration = check_iteration(state["iteration"], "Controller")
        stream = state.get("rng")
        if stream is not None:
            SeedStream(0).load_state_dict(stream)  # checked before anything changes
        check_modules(self.model, state.get("modules"), "Controller state")
        scales = state.get("channel_scales")
        if scales is not None:  # checked whole before anything changes
            scales = scales_from_state(scales)
        self.policy.load_state_dict(state["policy"])  # checks all first, then changes
        if scales is not None:
            self.saved_tensor_hooks.use_scales(scales)
        self.iteration = iteration
        if stream is not None:
            self.rng.load_state_dict(stream)

    def __repr__(self) -> str:
        return (
            f"Controller(level={self.level.name!r}, policy={self.policy!r}, "
            f"iteration={self.iteration}, installed={self._installed})"
        )
