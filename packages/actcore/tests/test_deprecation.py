"""actcore.deprecation: the one way a public name is retired."""

from __future__ import annotations

import pytest

from actcore.deprecation import deprecated


def test_a_deprecated_function_warns_at_the_callers_line_and_still_works():
    @deprecated("actcore.fit_budget", removed_in="0.3")
    def old(x: int) -> int:
        """Old."""
        return x + 1

    with pytest.warns(DeprecationWarning) as caught:
        assert old(1) == 2
    (warning,) = caught
    assert str(warning.message) == (
        "deprecated: use actcore.fit_budget instead; removed in actcore 0.3"
    )
    assert warning.filename == __file__
    assert old.__name__ == "old" and old.__doc__ == "Old."
    assert old.__deprecated__ == str(warning.message)  # PEP 702: type checkers see it


def test_a_deprecated_class_warns_when_built():
    @deprecated("actcore.budget.MemoryPlan", removed_in="0.3")
    class OldPlan:
        pass

    with pytest.warns(DeprecationWarning, match="use actcore.budget.MemoryPlan instead"):
        OldPlan()


@pytest.mark.parametrize(("replacement", "removed_in"), [("", "0.3"), ("actcore.x", "")])
def test_a_deprecation_must_say_what_instead_and_when(replacement, removed_in):
    with pytest.raises(ValueError, match="what to use instead and the version"):
        deprecated(replacement, removed_in=removed_in)
