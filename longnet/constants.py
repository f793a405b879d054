"""Constants shared by several layers; import-free, so any layer may use it."""

from __future__ import annotations

import math

IGNORE_INDEX = -100
"""Label value that takes no loss (``cross_entropy``'s default ``ignore_index``)."""

NATS_PER_BIT = math.log(2.0)
"""``ln 2``: nats divided by this are bits."""

DELTA_CONFIG = "lora.json"
"""The record of a LoRA delta folder (``training.lora``), beside ``lora.safetensors``."""
