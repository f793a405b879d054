"""Bits per byte by position in the document, and over the bytes from a position on
(docs/evaluation.md).

Both read ``score_documents(..., return_token_nll=True)``'s per-target NLLs (nats; the closing
EOS, which covers no byte, is left out). A token sits at the byte where it starts and counts its
bytes, so positions are in bytes for every tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longnet.validation import check_non_negative_int, check_positive_int

LN2 = math.log(2.0)
FIRST_BUCKET = 512


@dataclass(frozen=True)
class PositionBucket:
    """Bytes at document positions ``[start, end)``: how many were scored and their mean bits."""

    start: int
    end: int
    num_bytes: int
    bits_per_byte: float


def position_buckets(limit: int, first: int = FIRST_BUCKET) -> list[tuple[int, int]]:
    """``[(0, first), (first, 2 first), ...]``, the last bucket ending at ``limit``.

    Raises:
        ValueError: ``first`` or ``limit`` is not a positive integer.
    """
    first, limit = check_positive_int("first", first), check_positive_int("limit", limit)
    edges = [0]
    end = first
    while end < limit:
        edges.append(end)
        end *= 2
    edges.append(limit)
    return list(zip(edges[:-1], edges[1:]))


def _document_targets(
    token_nll: Sequence[np.ndarray], token_bytes: Sequence[np.ndarray] | None
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per document ``(nll, starts, counts)`` of its tokens, the closing EOS dropped: NLLs,
    starting byte positions and bytes covered."""
    if not token_nll:
        raise ValueError("token_nll is empty: score at least one document.")
    if token_bytes is not None and len(token_bytes) != len(token_nll):
        raise ValueError(f"token_bytes has {len(token_bytes)} documents, token_nll "
                         f"{len(token_nll)}; pass both of one scoring.")
    out = []
    for index, values in enumerate(token_nll):
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 1 or len(values) < 1:
            raise ValueError(f"document {index}: expected a (num_tokens + 1,) array of NLLs.")
        if np.isnan(values).any():
            raise ValueError(f"document {index}: some targets were not scored (NaN).")
        counts = (np.ones(len(values) - 1, dtype=np.int64) if token_bytes is None
                  else np.asarray(token_bytes[index], dtype=np.int64)[:-1])
        if len(counts) != len(values) - 1:
            raise ValueError(f"document {index}: token_bytes and token_nll differ in length.")
        starts = np.cumsum(counts) - counts
        out.append((values[:-1], starts, counts))
    return out


def bits_by_position(
    token_nll: Sequence[np.ndarray], buckets: Sequence[tuple[int, int]],
    token_bytes: Sequence[np.ndarray] | None = None,
) -> list[PositionBucket]:
    """Mean bits per byte of the tokens starting in each bucket, over all documents
    (``token_bytes``: as ``score_documents`` returns them; None: bytes). A bucket no document
    reaches has ``num_bytes == 0`` and ``bits_per_byte`` NaN."""
    documents = _document_targets(token_nll, token_bytes)
    out = []
    for start, end in buckets:
        if not 0 <= start < end:
            raise ValueError(f"bucket ({start}, {end}) must satisfy 0 <= start < end.")
        inside = [(starts >= start) & (starts < end) for _, starts, _ in documents]
        count = sum(int(counts[mask].sum()) for (_, _, counts), mask in zip(documents, inside))
        total = sum(float(values[mask].sum()) for (values, _, _), mask in zip(documents, inside))
        bits = total / LN2 / count if count else math.nan
        out.append(PositionBucket(start, end, count, bits))
    return out


def bits_from_position(token_nll: Sequence[np.ndarray], start: int,
                       token_bytes: Sequence[np.ndarray] | None = None) -> PositionBucket:
    """Mean bits per byte of every byte at document position ``>= start``.

    Raises:
        ValueError: no document is longer than ``start`` bytes.
    """
    start = check_non_negative_int("start", start)
    documents = _document_targets(token_nll, token_bytes)
    longest = max(int(counts.sum()) for _, _, counts in documents)
    if longest <= start:
        raise ValueError(
            f"no byte at position >= {start}: the longest document has {longest} bytes; lower "
            "the start or evaluate longer documents."
        )
    (bucket,) = bits_by_position(token_nll, [(start, longest)], token_bytes)
    return bucket
