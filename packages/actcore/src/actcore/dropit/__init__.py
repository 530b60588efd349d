"""DropIT: keep only the largest-magnitude part of the inputs that Linear and conv layers save.

A Linear or conv layer keeps its input alive until backward only to compute its weight
gradient. DropIT (Chen et al., ICLR 2023) drops the ``gamma`` fraction of smallest-magnitude
elements of that saved input ("min-k") and computes the weight gradient from what is left::

    from actcore.dropit import to_dropit
    report = to_dropit(model, strategy="mink", gamma=0.9)   # swaps layers in place
    print(report)                                           # converted / skipped layers

Semantics of a converted layer (while autograd records; under ``no_grad`` or with
``gamma == 0`` it is exactly the plain layer):

* forward output: exactly the plain layer's (same aten ops, also under autocast);
* input gradient: exact (it needs only the weight, which is never dropped);
* bias gradient: exact;
* weight gradient: computed from the input with all but its ``k`` largest-magnitude elements
  set to zero, ``k = numel - floor(gamma * numel)``. Exactly ``k`` elements are kept
  (``torch.topk``; among equal magnitudes at the threshold the choice is topk's). For convs,
  "the input" is what torch convolves: after the explicit padding torch itself applies
  (padding modes other than ``"zeros"``, the odd extra element of ``padding="same"``).
* not twice differentiable (``once_differentiable``).

Layers: ``nn.Linear``, ``nn.Conv1d/2d/3d`` (exact classes, not subclasses) and transformers'
``Conv1D`` (GPT-2), the latter only when ``transformers.pytorch_utils`` is already imported:
this module never imports transformers.

Strategies: ``"mink"`` (DropIT's default) ranks the whole input tensor of the layer at once;
``"mink_sample"`` ranks each sample (index of dim 0) on its own, so every sample keeps the same
fraction.

What is stored: the kept values in the dtype the layer computes in (the autocast dtype under
autocast, as autocast would save), plus their positions as a
1-bit bitmap (:func:`actcore.ops.pack_mask`) or as int16/int32 offsets, whichever is smaller
(offsets win only when fewer than 1/16 or 1/32 of the elements are kept); never int64. For fp32
and ``gamma=0.9`` that is ``0.1 * 4 + 1/8 = 0.525`` bytes per element instead of 4 (13%).

Skipping: modules whose dotted name matches a ``skip`` pattern (``fnmatch`` syntax, e.g.
``"head"`` or ``"layer1.*"``), and modules with an attribute ``dropit_skip = True``, stay plain,
and so does everything inside such a module.

Whether a saving is real: a layer's input is often kept alive for backward by another node
too, e.g. the output of a ``ReLU`` (in-place or not), which the ReLU saves for its own
backward. Compressing such an input frees nothing and adds the compressed copy.
:func:`measure_saving` (or ``to_dropit(..., example_inputs=...)``) runs the model under
:mod:`actcore.memory` with and without DropIT and reports, per layer, the bytes really freed;
layers whose saving is not positive are listed in ``not_real`` (``revert_unreal=True`` makes
them plain again). A layer reading the model's own input is counted as a real saving, as
:mod:`actcore.memory` counts it; it is real only if the caller drops the batch before backward.

Modules: :mod:`~actcore.dropit.mink` (the min-k compressor and its settings),
:mod:`~actcore.dropit.function` (the layer math and its autograd Function),
:mod:`~actcore.dropit.modules` (the DropIT layers), :mod:`~actcore.dropit.convert`
(``to_dropit``, ``remove_dropit``), :mod:`~actcore.dropit.saving` (``measure_saving``).
"""

from __future__ import annotations

from typing import Any

from . import modules as _modules
from .convert import DropITReport, remove_dropit, to_dropit
from .mink import STRATEGIES, Kept, drop_mink, num_kept
from .modules import DropITConv1d, DropITConv2d, DropITConv3d, DropITLinear, is_dropit
from .saving import LayerSaving, SavingReport, measure_saving

__all__ = [
    "STRATEGIES",
    "DropITConv1d",
    "DropITConv2d",
    "DropITConv3d",
    "DropITLinear",
    "DropITReport",
    "Kept",
    "LayerSaving",
    "SavingReport",
    "drop_mink",
    "is_dropit",
    "measure_saving",
    "num_kept",
    "remove_dropit",
    "to_dropit",
]


def __getattr__(name: str) -> Any:
    # the DropIT class of transformers' Conv1D is made on first conversion, in .modules
    if name == "DropITConv1D" and name in vars(_modules):
        return vars(_modules)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
