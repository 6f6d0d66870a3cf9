"""``python -m vescale_zero.gpu_check --out DIR``: the GPU check's command, kept at this name (the
check itself lives with the other tools: :mod:`vescale_zero.tools.gpu_check`)."""

import sys

from .tools.gpu_check.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
