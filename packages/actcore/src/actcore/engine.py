"""Deprecated alias of :mod:`actcore.stash` (the Q-layers' stash/unstash mechanism).

``actcore.engine`` was renamed ``actcore.stash``: "engine" now names only the compression
core that both routes share. Importing this module warns once and gives
:mod:`actcore.stash` itself (same functions, same per-tensor records). It will be removed
in the next release.
"""

from __future__ import annotations

import sys
import warnings

from . import stash as _stash

__all__ = _stash.__all__

warnings.warn(
    "actcore.engine is deprecated and will be removed in the next release: it was renamed "
    "actcore.stash (the Q-layers' stash/unstash save-restore mechanism); import from "
    "actcore.stash instead",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _stash
