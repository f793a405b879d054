"""``python -m longnet fit --config configs/quickstart.yaml`` (same as the ``longnet`` command)."""

import sys

from longnet.cli import main

if __name__ == "__main__":
    sys.exit(main())
