"""Bits per byte (and perplexity) versus context length for several models, as table rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from longnet.data import ByteTokenizer
from longnet.eval.documents import EvalDocument
from longnet.eval.loading import LoadedModel
from longnet.eval.reporting import powers_of_two
from longnet.eval.sliding import check_context_length, resolve_stride, score_documents

MIN_CONTEXT = 1024
EXTRAPOLATION_FACTOR = 16


def default_context_lengths(models: Sequence[LoadedModel]) -> list[int]:
    """Powers of two from 1K to 16x the longest training length (``max_positions``)."""
    longest = max(item.training_length for item in models)
    return powers_of_two(MIN_CONTEXT, max(MIN_CONTEXT, EXTRAPOLATION_FACTOR * longest))


def evaluate_bits_per_byte(
    models: Sequence[LoadedModel],
    documents: Sequence[EvalDocument],
    context_lengths: Sequence[int],
    *,
    stride: int | float | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One row per (model, context length), models outer.

    Every length is checked against every model before any work starts.

    Row keys: ``model``, ``training_length`` (``max_positions``), ``context_length``,
    ``stride``, ``documents``, ``bytes``, ``tokens`` (scored targets: bytes + one EOS per
    document), ``windows``, ``longest_window``, ``nll_nats`` (summed), ``bits_per_byte``,
    ``bits_per_token``, ``perplexity`` (per token), ``seconds`` (wall time of the scoring).
    """
    if not context_lengths:
        raise ValueError("give at least one context length.")
    for item in models:
        if item.model.config.vocab_size != ByteTokenizer.vocab_size:
            raise ValueError(
                f"{item.label}: the documents are bytes (vocab 256) but the model has "
                f"vocab_size {item.model.config.vocab_size}; evaluate a byte-level model."
            )
        for length in context_lengths:
            check_context_length(length, item.model)
            resolve_stride(length, stride)
    rows = []
    for item in models:
        for length in context_lengths:
            started = time.perf_counter()
            result = score_documents(
                item.model,
                documents,
                length,
                stride,
                batch_size=batch_size,
                progress=f"{item.label} @ {length}" if progress else False,
            )
            rows.append({
                "model": item.label,
                "training_length": item.training_length,
                "context_length": length,
                "stride": result.stride,
                "documents": result.num_documents,
                "bytes": result.num_bytes,
                "tokens": result.num_tokens,
                "windows": result.num_windows,
                "longest_window": result.longest_window,
                "nll_nats": result.nll_sum,
                "bits_per_byte": result.bits_per_byte,
                "bits_per_token": result.bits_per_token,
                "perplexity": result.perplexity,
                "seconds": round(time.perf_counter() - started, 2),
            })
    return rows
