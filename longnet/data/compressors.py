"""Compressor baselines: bits per byte of general-purpose compressors on the same documents.

``8 * compressed bytes / raw bytes`` at each tool's strongest setting; ``mode="separate"``
compresses every document alone (as the model scores it), ``"concatenated"`` as one stream.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": lambda data: gzip.compress(data, compresslevel=9, mtime=0),
    "bzip2": lambda data: bz2.compress(data, compresslevel=9),
    "xz": lambda data: lzma.compress(data, preset=9 | lzma.PRESET_EXTREME),
}
MODES = ("separate", "concatenated")


@dataclass(frozen=True)
class CompressorBaseline:
    """Attributes: compressor name, mode, raw and compressed sizes in bytes."""

    compressor: str
    mode: str
    raw_bytes: int
    compressed_bytes: int

    @property
    def bits_per_byte(self) -> float:
        return 8.0 * self.compressed_bytes / self.raw_bytes


def compressor_baselines(
    documents: Sequence[bytes | np.ndarray],
    modes: Sequence[str] = MODES,
    compressors: Sequence[str] | None = None,
) -> list[CompressorBaseline]:
    """Bits per byte of each compressor (default: all) in each mode on ``documents`` (``bytes``
    or ``(n,)`` uint8 arrays)."""
    names = list(COMPRESSORS) if compressors is None else list(compressors)
    for name in names:
        if name not in COMPRESSORS:
            raise ValueError(f"unknown compressor {name!r}; known: {list(COMPRESSORS)}.")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown compression mode {mode!r}; known: {list(MODES)}.")
    blobs = [doc if isinstance(doc, bytes) else np.asarray(doc, np.uint8).tobytes()
             for doc in documents]
    raw = sum(len(blob) for blob in blobs)
    if raw == 0:
        raise ValueError("the documents hold no bytes; nothing to compress.")
    results = []
    for name in names:
        compress = COMPRESSORS[name]
        for mode in modes:
            if mode == "separate":
                size = sum(len(compress(blob)) for blob in blobs)
            else:
                size = len(compress(b"".join(blobs)))
            results.append(CompressorBaseline(name, mode, raw, size))
    return results
