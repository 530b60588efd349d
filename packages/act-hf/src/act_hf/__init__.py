"""act_hf: the Hugging Face adapter of ACT (activation-compressed training for PyTorch).

Skeleton package. ``act_hf.convert(model, ...)`` for any ``PreTrainedModel`` and an
attention function registered through transformers' attention interface land in their
own issue.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
