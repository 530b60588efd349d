"""The one way actcore retires a public name: :func:`deprecated`.

0.1.0 has no deprecated names (the pre-release aliases were removed, not kept). A name
retired after a release keeps working for one minor version behind this decorator: it
warns with :class:`DeprecationWarning` at the caller's line, says what to use instead and
when the name goes, and type checkers flag its uses (PEP 702, through
``typing_extensions.deprecated``)::

    @deprecated("actcore.fit_budget", removed_in="0.3")
    def plan_budget(*args, **kwargs):
        return fit_budget(*args, **kwargs)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from typing_extensions import deprecated as _pep702_deprecated

__all__ = ["deprecated"]

T = TypeVar("T")


def deprecated(replacement: str, *, removed_in: str) -> Callable[[T], T]:
    """Mark a function or class as deprecated in favour of ``replacement`` (a dotted name
    or a short instruction), to be removed in actcore ``removed_in``."""
    if not replacement or not removed_in:
        raise ValueError(
            f"a deprecation names what to use instead and the version that removes it, "
            f"got replacement={replacement!r}, removed_in={removed_in!r}"
        )
    message = f"deprecated: use {replacement} instead; removed in actcore {removed_in}"
    return _pep702_deprecated(message, category=DeprecationWarning, stacklevel=1)
