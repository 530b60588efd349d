"""``python -m actcore.native build --check`` / ``status``: the ``actcore native`` CLI."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
