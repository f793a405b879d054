"""Bits per byte (and perplexity) versus context length for several models, as table rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from longnet.eval.documents import EvalDocument, tokenize_documents
from longnet.eval.loading import LoadedModel
from longnet.eval.positions import bits_by_position, bits_from_position
from longnet.eval.reporting import powers_of_two
from longnet.eval.sliding import (
    SlidingWindowResult,
    check_context_length,
    resolve_stride,
    score_documents,
)

MIN_CONTEXT = 1024
EXTRAPOLATION_FACTOR = 16


def default_context_lengths(models: Sequence[LoadedModel]) -> list[int]:
    """Powers of two from 1K to 16x the longest training length (``max_positions``)."""
    longest = max(item.training_length for item in models)
    return powers_of_two(MIN_CONTEXT, max(MIN_CONTEXT, EXTRAPOLATION_FACTOR * longest))


@dataclass(frozen=True)
class ContextScore:
    """One model scored at one context length, with the per-target NLLs and the wall time."""

    model: LoadedModel
    result: SlidingWindowResult
    seconds: float


def score_models(
    models: Sequence[LoadedModel],
    documents: Sequence[EvalDocument],
    context_lengths: Sequence[int],
    *,
    stride: int | float | None = None,
    batch_size: int = 1,
    progress: bool = False,
    on_score: Callable[[ContextScore], None] | None = None,
) -> list[ContextScore]:
    """Score byte ``documents`` with every model (outer, each in its own tokenizer) at every
    context length, keeping the per-target NLLs; every length is checked against every model
    first. ``progress``: a tqdm bar per model and length; ``on_score`` gets each score as soon
    as it is computed."""
    if not context_lengths:
        raise ValueError("give at least one context length.")
    for item in models:
        for length in context_lengths:
            check_context_length(length, item.model)
            resolve_stride(length, stride)
    scores = []
    for item in models:
        tokenized = tokenize_documents(documents, item.tokenizer)
        for length in context_lengths:
            started = time.perf_counter()
            result = score_documents(
                item.model,
                tokenized,
                length,
                stride,
                batch_size=batch_size,
                return_token_nll=True,
                progress=f"{item.label} @ {length}" if progress else False,
            )
            scores.append(ContextScore(item, result, round(time.perf_counter() - started, 2)))
            if on_score is not None:
                on_score(scores[-1])
    return scores


def bits_per_byte_rows(
    scores: Sequence[ContextScore], score_from: int | None = None
) -> list[dict[str, Any]]:
    """One row per score.

    Columns: those of :class:`~longnet.eval.sliding.SlidingWindowResult` plus ``model``,
    ``training_length`` and ``seconds`` (docs/evaluation.md); with ``score_from`` also
    ``scored_from``, ``scored_bytes`` and ``scored_bits_per_byte`` (bytes at document
    positions ``>= score_from`` only).
    """
    rows = []
    for score in scores:
        result = score.result
        row = {
            "model": score.model.label,
            "training_length": score.model.training_length,
            "context_length": result.context_length,
            "context_bytes": round(result.context_bytes),
            "stride": result.stride,
            "documents": result.num_documents,
            "bytes": result.num_bytes,
            "tokens": result.num_tokens,
            "bytes_per_token": round(result.bytes_per_token, 4),
            "windows": result.num_windows,
            "longest_window": result.longest_window,
            "nll_nats": result.nll_sum,
            "bits_per_byte": result.bits_per_byte,
            "bits_per_token": result.bits_per_token,
            "perplexity": result.perplexity,
            "seconds": score.seconds,
        }
        if score_from is not None:
            scored = bits_from_position(result.token_nll, score_from, result.token_bytes)
            row |= {"scored_from": score_from, "scored_bytes": scored.num_bytes,
                    "scored_bits_per_byte": scored.bits_per_byte}
        rows.append(row)
    return rows


def position_rows(
    scores: Sequence[ContextScore], buckets: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """One row per (score, position bucket ``[start, end)``): ``model``, ``context_length``,
    ``start``, ``end``, ``bytes``, ``bits_per_byte``."""
    return [
        {"model": score.model.label, "context_length": score.result.context_length,
         "start": bucket.start, "end": bucket.end, "bytes": bucket.num_bytes,
         "bits_per_byte": bucket.bits_per_byte}
        for score in scores
        for bucket in bits_by_position(score.result.token_nll, buckets, score.result.token_bytes)
    ]

