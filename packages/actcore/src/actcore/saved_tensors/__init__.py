"""The saved-tensor hooks route: compress whatever autograd saves (:mod:`.hooks`:
``SavedTensorHooks``, ``compress_saved_tensors``, also ``actcore.compress_saved_tensors``),
the handles autograd holds (:mod:`.handles`), what the hooks know of the op that saves
(:mod:`.op_mode`, :mod:`.exact_ops`) and what an estimating pass records
(:mod:`.pass_stats`).

The package imports none of them: the compressors use :mod:`.handles` and :mod:`.pass_stats`,
and :mod:`.hooks` uses the compressors.
"""

from __future__ import annotations

__all__: list[str] = []
