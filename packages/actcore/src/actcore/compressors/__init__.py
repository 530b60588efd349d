"""Compressors: turn a tensor saved for backward into a few compact tensors and back.

A compressor's ``pack(x)`` returns ``(tensors, meta)``: the tensors go through
``ctx.save_for_backward`` (so autograd's in-place checks, saved-tensor hooks and memory
accounting all see them), ``meta`` is small Python data. ``unpack(tensors, meta)`` rebuilds
the tensor, and ``unbiased`` says whether ``E[unpack(pack(x))] == x``. Both routes
(Q-layers and saved-tensor hooks) use these same objects; each lives in a module of its own:

* :mod:`~actcore.compressors.base`: the protocol (:class:`Compressor`) and ``IDENTITY``;
* :mod:`~actcore.compressors.quantize`: :class:`Quantize`, per-group k-bit quantization;
* :mod:`~actcore.compressors.seeded_quantize`: :class:`SeededQuantize`, with a fixed seed;
* :mod:`~actcore.compressors.per_sample_quantize`: :class:`PerSampleQuantize`, bits per
  sample (and :func:`sample_range_weights`, which ranks the samples);
* :mod:`~actcore.compressors.scored_per_sample_quantize`: :class:`ScoredPerSampleQuantize`,
  samples ranked by given scores (adaptive bits' per-dataset-sample weights);
* :mod:`~actcore.compressors.channel_scaled`: :class:`ChannelScaled`, outlier channels
  scaled down before another compressor packs;
* :mod:`~actcore.compressors.mask_bits`: :class:`MaskBits`, a bool tensor at 1 bit;
* :mod:`~actcore.compressors.zero_value`: :class:`ZeroValue`, a mask and the nonzeros;
* :mod:`~actcore.compressors.derived`: :class:`Derived`, rebuilt from other packings;
* :mod:`~actcore.compressors.swap`: :class:`Swap`, to pinned CPU memory and back
  (:class:`PrefetchQueue`);
* :mod:`~actcore.compressors.tapped`: :class:`Tapped`, hands what it packs to a tap
  (statistics of adaptive bits and of an adaptive policy's estimate).
"""

from __future__ import annotations

from .base import IDENTITY, Compressor, Packing, Tensors
from .channel_scaled import ChannelScaled
from .derived import Derived
from .mask_bits import MaskBits
from .per_sample_quantize import PerSampleQuantize, sample_range_weights
from .quantize import Quantize
from .scored_per_sample_quantize import ScoredPerSampleQuantize
from .seeded_quantize import SeededQuantize
from .swap import PrefetchQueue, Swap
from .tapped import Tapped
from .zero_value import ZeroValue

__all__ = [
    "IDENTITY",
    "ChannelScaled",
    "Compressor",
    "Derived",
    "MaskBits",
    "Packing",
    "PerSampleQuantize",
    "PrefetchQueue",
    "Quantize",
    "ScoredPerSampleQuantize",
    "SeededQuantize",
    "Swap",
    "Tapped",
    "Tensors",
    "ZeroValue",
    "sample_range_weights",
]
