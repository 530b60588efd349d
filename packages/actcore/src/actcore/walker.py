"""The one conversion walker: visit a model's modules once, leave excluded ones (and all
inside them) alone, and let a chain of converters decide about every other module.

:func:`actcore.convert`, :func:`actcore.dropit.to_dropit` and the adapters all convert
through :func:`walk`. An adapter does not walk models itself: it declares what it swaps
(:func:`actcore.layers.register_q_layer`, :func:`actcore.fewbit.convert.register_activation`)
or passes a converter for what needs its own options (act-pyg's message-passing layers).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = [
    "EXCLUDED",
    "Converter",
    "Exclude",
    "Left",
    "Walk",
    "check_exclude",
    "is_excluded",
    "walk",
]

Exclude = str | type | Callable[[str, nn.Module], bool]
"""An exclusion rule: a module name or fnmatch pattern, a module type, or a predicate."""

EXCLUDED = "excluded"


@dataclass(frozen=True)
class Left:
    """A converter's answer for a module it knows but leaves: why, and whether to warn."""

    reason: str
    warn: bool = False


Converter = Callable[[str, nn.Module], "str | Left | None"]
"""``(name, module) -> new class name | Left(reason) | None`` (None: not its business)."""


@dataclass
class Walk:
    """What :func:`walk` did: converted names (-> class name), left ones (-> reason), and the
    modules an exclusion named (not those merely inside them)."""

    converted: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, nn.Module] = field(default_factory=dict)


def _names(name: str, pattern: str) -> bool:
    """Whether the name pattern ``pattern`` (fnmatch, or the name itself) names ``name``."""
    return fnmatch.fnmatchcase(name, pattern) or name == pattern


def is_excluded(name: str, module: nn.Module, exclude: Iterable[Exclude]) -> bool:
    """Whether ``exclude`` (names or fnmatch patterns, types, predicates) names ``module``."""
    for rule in exclude:
        if isinstance(rule, str) and _names(name, rule):
            return True
        if isinstance(rule, type) and isinstance(module, rule):
            return True
        if callable(rule) and not isinstance(rule, type) and rule(name, module):
            return True
    return False


def check_exclude(exclude: str | Iterable[Exclude]) -> tuple[Exclude, ...]:
    """``exclude`` as a tuple of rules, or TypeError naming a rule that is none of the kinds."""
    rules = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    for rule in rules:
        if not (isinstance(rule, (str, type)) or callable(rule)):
            raise TypeError(
                "exclude takes module names (fnmatch patterns), module types or "
                f"predicates (name, module) -> bool; got {rule!r}"
            )
    return rules


def _rules_reason(rules: tuple[Exclude, ...]) -> Callable[[str, nn.Module], str | None]:
    def reason(name: str, module: nn.Module) -> str | None:
        return EXCLUDED if rules and name and is_excluded(name, module, rules) else None

    return reason


def walk(
    model: nn.Module,
    converters: Sequence[Converter],
    *,
    exclude: Iterable[Exclude] | Callable[[str, nn.Module], str | None] = (),
    inside: Callable[[str, str], str] = lambda outer, reason: reason,
    on_excluded: Callable[[str, nn.Module], None] | None = None,
) -> Walk:
    """Visit ``model``'s modules (pre-order), each once, and convert them.

    ``exclude``: rules (see :data:`Exclude`; the root is never excluded by them), or a
    function ``(name, module) -> reason | None``. An excluded module and everything inside
    it is left with that reason (``inside(outer_name, reason)`` for those inside) and handed
    to ``on_excluded``. Every other module goes to the ``converters`` in order; the first
    that answers (not None) decides. A :class:`Left` with ``warn`` also warns.
    """
    rules = () if callable(exclude) else check_exclude(exclude)
    reason_of = exclude if callable(exclude) else _rules_reason(rules)
    aliases: dict[int, list[str]] = {}  # a module reachable under several names: all of them
    for alias, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(alias)
    done = Walk()
    for name, module in model.named_modules():
        outer = next((n for n in done.excluded if n == "" or name.startswith(f"{n}.")), None)
        if outer is not None:
            done.left[name] = inside(outer, done.left[outer])
        else:
            why = reason_of(name, module)
            for alias in aliases[id(module)] if why is None else ():
                if alias != name and (found := reason_of(alias, module)) is not None:
                    why = f"{found} (as {alias})"
                    break
            if why is None:
                _decide(name, module, converters, done)
                continue
            done.excluded[name] = module
            done.left[name] = why
        if on_excluded is not None:
            on_excluded(name, module)
    _warn_unmatched(rules, aliases, model)
    return done


def _warn_unmatched(
    rules: tuple[Exclude, ...], aliases: dict[int, list[str]], model: nn.Module
) -> None:
    """Warn about each name pattern of ``exclude`` that names no module (a typo excludes
    nothing, silently, otherwise)."""
    names = [n for group in aliases.values() for n in group if n]
    for rule in rules:
        if isinstance(rule, str) and not any(_names(n, rule) for n in names):
            some = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            warnings.warn(
                f"exclude pattern {rule!r} matches no module of {type(model).__name__} "
                f"(its modules: {some})",
                stacklevel=4,
            )


def _decide(name: str, module: nn.Module, converters: Sequence[Converter], done: Walk) -> None:
    for converter in converters:
        answer = converter(name, module)
        if answer is None:
            continue
        if isinstance(answer, Left):
            done.left[name] = answer.reason
            if answer.warn:
                warnings.warn(
                    f"actcore left {name or '<root>'} unconverted: {answer.reason}", stacklevel=4
                )
        else:
            done.converted[name] = answer
        return
