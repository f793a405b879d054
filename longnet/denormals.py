"""Subnormal floats on the CPU: flushed to zero while a training command runs.

Why: a trained model's attention is sharp. The backward of the CPU flash-attention kernel
recomputes ``exp(score - logsumexp)``, and for most keys of a long row that value falls below
float32's smallest normal number (about 1.2e-38), into the subnormal range, where x86 cores
compute many times slower than on normal numbers. Flushing subnormals to zero removes that
cost and changes only values below 1.2e-38 (float32) or 2.2e-308 (float64), which a loss or a
gradient never needs. The measured effect on a training step is in docs/training.md
("Subnormal floats").

The setting belongs to a thread: ``torch.set_flush_denormal`` sets it on the calling thread,
and torch's intra-op threads copy it from the thread that starts them, once. So it takes
effect on every thread only when set before the process's first parallel operation: the
``longnet`` command does it first thing; in a script of your own, call
``torch.set_flush_denormal(True)`` right after ``import torch``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

KEEP_DENORMALS_ENV = "LONGNET_KEEP_DENORMALS"
"""Set to 1 to keep subnormal floats (the ``longnet`` command then leaves the CPU as it is);
inherited by the processes a distributed run starts."""


def denormals_kept() -> bool:
    """Whether the environment asks to keep subnormal floats (:data:`KEEP_DENORMALS_ENV`)."""
    return os.environ.get(KEEP_DENORMALS_ENV, "").strip().lower() in ("1", "true", "yes")


@contextmanager
def flushing_denormals(enabled: bool = True) -> Iterator[bool]:
    """Flush subnormal floats to zero on the CPU inside the block (and on the intra-op threads
    started inside it), then restore torch's default (kept). Yields whether it flushes: False
    when ``enabled`` is False or the CPU cannot (no SSE3)."""
    flushing = enabled and torch.set_flush_denormal(True)
    try:
        yield flushing
    finally:
        if flushing:
            torch.set_flush_denormal(False)
