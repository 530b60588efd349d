"""Q-layers: torch layers that keep compressed activations for backward."""

from __future__ import annotations

from . import modules
from .modules import *  # noqa: F403 - the layers are this package's API

__all__ = list(modules.__all__)
