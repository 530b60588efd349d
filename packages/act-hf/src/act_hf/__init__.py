"""act_hf: the Hugging Face adapter of ACT (activation-compressed training for PyTorch).

``act_hf.convert(model, level="L3")`` compresses what any ``PreTrainedModel`` keeps for
backward: linear/``Conv1D``/norm inputs quantized, activation derivatives at a few bits,
dropout masks at 1 bit, and the model's own attention implementation (sdpa, eager, ...)
with q, k, v compressed; ``attention="act_eager"`` switches to the eager attention function
that :mod:`act_hf.attention` registers in transformers' ``AttentionInterface``.
``ACTCallback`` does it under ``Trainer``.
"""

from __future__ import annotations

from .attention import (
    ATTENTION_NAME,
    act_eager_attention_forward,
    attention_bits,
    register_attention,
)
from .convert import HFConversionReport, convert, default_fewbit_bits
from .layers import QConv1D

__version__ = "0.1.0"

register_attention()


def __getattr__(name: str):
    if name == "ACTCallback":  # imports transformers' trainer machinery only when asked
        from .trainer import ACTCallback

        return ACTCallback
    raise AttributeError(f"module 'act_hf' has no attribute {name!r}")


__all__ = [
    "ATTENTION_NAME",
    "ACTCallback",
    "HFConversionReport",
    "QConv1D",
    "__version__",
    "act_eager_attention_forward",
    "attention_bits",
    "convert",
    "default_fewbit_bits",
    "register_attention",
]
