"""Subnormal floats on the CPU: flushed to zero while a training command runs.

The backward of a sharp attention makes subnormal floats, which x86 computes slowly
(docs/training.md, "Subnormal floats"). Intra-op threads copy the per-thread setting once:
set it right after ``import torch``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

KEEP_DENORMALS_ENV = "LONGNET_KEEP_DENORMALS"
"""Set to 1 to keep subnormal floats (inherited by a distributed run's processes)."""


def denormals_kept() -> bool:
    """Whether the environment asks to keep subnormal floats (:data:`KEEP_DENORMALS_ENV`)."""
    return os.environ.get(KEEP_DENORMALS_ENV, "").strip().lower() in ("1", "true", "yes")


@contextmanager
def flushing_denormals(enabled: bool = True) -> Iterator[bool]:
    """Flush CPU subnormals to zero inside the block; yields whether it flushes (SSE3 needed)."""
    flushing = enabled and torch.set_flush_denormal(True)
    try:
        yield flushing
    finally:
        if flushing:
            torch.set_flush_denormal(False)
