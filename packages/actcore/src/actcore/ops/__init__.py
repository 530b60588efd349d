"""Compression primitives: per-group k-bit quantization, bit packing, 1-bit masks.

Every op is a ``torch.library`` operator (``torch.ops.actcore.*``) with a fake kernel and
a pure-PyTorch reference implementation that runs on any device.
"""

from __future__ import annotations

from . import api
from .api import *  # noqa: F403 - the checked ops are this package's API
from .packed import Packed

__all__ = [*api.__all__, "Packed"]
