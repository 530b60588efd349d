"""Deprecated alias of :mod:`actcore.saved_tensor_hooks` (the saved-tensor hooks route).

``actcore.hooks`` was renamed ``actcore.saved_tensor_hooks``; the compressors it defined
(``MaskBits``, ``SeededQuantize``) moved to :mod:`actcore.compressors`. Importing this
module warns once and gives :mod:`actcore.saved_tensor_hooks` itself. It will be removed
in the next release.
"""

from __future__ import annotations

import sys
import warnings

from . import saved_tensor_hooks as _saved_tensor_hooks

__all__ = _saved_tensor_hooks.__all__

warnings.warn(
    "actcore.hooks is deprecated and will be removed in the next release: it was renamed "
    "actcore.saved_tensor_hooks (compress_saved_tensors, SavedTensorHooks); its "
    "compressors MaskBits and SeededQuantize moved to actcore.compressors",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _saved_tensor_hooks
