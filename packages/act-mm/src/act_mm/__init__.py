"""act_mm: the OpenMMLab adapter of ACT (activation-compressed training for PyTorch).

Skeleton package. Registering actcore's Q-layers in mmengine's root ``MODELS`` registry,
a runner hook that converts a whole model from one config key, and configs for stock
OpenMMLab models land in their own issue.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
