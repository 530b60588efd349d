"""How a benchmark applies a level to a model: layer swap (``convert``) or saved-tensor hooks.

``fp`` is the untouched model (plain PyTorch), the reference every ratio is taken against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = [
    "FP",
    "HOOKS_UNAVAILABLE",
    "ROUTES",
    "RouteUnavailable",
    "applied",
    "check_levels",
    "chosen_levels",
    "hooks_available",
    "route_levels",
]

FP = "fp"
ROUTES = ("layers", "hooks")
HOOKS_UNAVAILABLE = "hooks route not available in this version (actcore.Controller is missing)"


class RouteUnavailable(RuntimeError):
    """The requested route does not exist in this version of actcore."""


def hooks_available() -> bool:
    """Whether this actcore has the saved-tensor hooks route (``actcore.Controller``)."""
    import actcore

    return hasattr(actcore, "Controller")


def _controller(model: nn.Module, level: str) -> Any:
    import actcore

    if not hooks_available():
        raise RouteUnavailable(HOOKS_UNAVAILABLE)
    return actcore.Controller(model, level=level)


def route_levels(route: str) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """``route``'s own level table and the one function that resolves its level names.

    The layer route (``actcore.convert``) has ActNN's levels (``L0`` .. ``L5``),
    :data:`actcore.config.LEVELS` resolved by :func:`actcore.config.level_spec`; the hooks
    route (``actcore.Controller``) GACT's, renamed ``G0`` .. ``G3``,
    :data:`actcore.config.HOOK_LEVELS` resolved by :func:`actcore.config.hook_level`.
    """
    if route == "layers":
        from ..config import LEVELS, level_spec

        return LEVELS, level_spec
    if route == "hooks":
        from ..config import HOOK_LEVELS, hook_level

        return HOOK_LEVELS, hook_level
    raise ValueError(f"unknown route {route!r}; valid routes: {', '.join(ROUTES)}")


def check_levels(levels: list[str], route: str = "layers") -> list[str]:
    """``levels`` if each is a level of ``route`` (``fp`` always is), else ValueError.

    Each name is resolved by ``route``'s own resolver (:func:`route_levels`). The error
    names the bad level and lists the valid ones; an unavailable route raises
    :class:`RouteUnavailable`.
    """
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; valid routes: {', '.join(ROUTES)}")
    if not levels:
        raise ValueError("no levels given")
    if route == "hooks" and not hooks_available():
        raise RouteUnavailable(HOOKS_UNAVAILABLE)
    try:
        table, resolve = route_levels(route)
    except ImportError:  # no table: the Controller knows its levels, ask it on a throwaway
        for level in levels:
            if level != FP:
                try:
                    _controller(nn.Linear(1, 1), level)
                except (ValueError, KeyError) as err:
                    raise ValueError(f"level {level!r} of the hooks route: {err}") from None
        return levels
    where = "" if route == "layers" else " for --route hooks"
    for level in levels:
        if level == FP:
            continue
        try:
            resolve(level)
        except ValueError:
            valid = ", ".join([FP, *table])
            raise ValueError(f"unknown level {level!r}{where}; valid levels: {valid}") from None
    return levels


def chosen_levels(given: list[str] | None, default: str, route: str) -> list[str]:
    """The levels a command runs on ``route``: ``given``, else its ``default`` (comma-separated
    layer-route names; on the hooks route each ``Lk`` becomes its namesake ``Gk``, GACT's
    ``Lk``), checked by :func:`check_levels`."""
    if given is None:
        given = [part.strip() for part in default.split(",")]
        if route == "hooks":
            given = [FP if lv == FP else "G" + lv[1:] for lv in given]
    return check_levels(given, route)


@contextlib.contextmanager
def applied(model: nn.Module, level: str, route: str = "layers") -> Iterator[Callable | None]:
    """Run the block with ``level`` applied to ``model`` by ``route``.

    Yields a callable ``after_step(backprop)`` to call after each training step (the hooks
    route's ``Controller.iterate``), or None. Layer swap converts ``model`` in place.
    """
    if level == FP:
        yield None
        return
    if route == "layers":
        import actcore

        actcore.convert(model, level=level)
        yield None
        return
    ctrl = _controller(model, level)
    ctrl.install_hook()
    try:
        iterate = getattr(ctrl, "iterate", None)
        yield iterate if callable(iterate) else None
    finally:
        ctrl.uninstall_hook()
