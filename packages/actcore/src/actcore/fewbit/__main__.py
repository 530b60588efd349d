"""``python -m actcore.fewbit [--write [PATH] | --check] [--activation NAME]``: the tables."""

from __future__ import annotations

import sys

from .tables import main

if __name__ == "__main__":
    sys.exit(main())
