"""``python -m longnet.cli`` (same as ``python -m longnet`` and the ``longnet`` command)."""

import sys

from longnet.cli import main

if __name__ == "__main__":
    sys.exit(main())
