"""Deprecated alias of :mod:`longnet.memory` (the memory models of a rank), kept for one
release: importing it warns and gives the same names."""

import warnings

from longnet.memory import AttentionSetup, MemoryPlan, RankMemory, format_bytes, plan_memory

warnings.warn(
    "longnet.planning is renamed longnet.memory and will be removed in the next release; "
    "import from longnet.memory.",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["AttentionSetup", "MemoryPlan", "RankMemory", "format_bytes", "plan_memory"]
