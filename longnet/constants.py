"""Constants shared by several layers, each defined once.

Import-free (like :mod:`longnet.validation`), so every layer from ``longnet.attention`` to
``longnet.eval`` may use it.
"""

from __future__ import annotations

import math

IGNORE_INDEX = -100
"""Label value that takes no loss (``torch.nn.functional.cross_entropy``'s default
``ignore_index``): padding and positions that are not scored."""

NATS_PER_BIT = math.log(2.0)
"""``ln 2``: a code length in nats divided by this is in bits (bits per byte, bits per
token)."""
