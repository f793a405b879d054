"""Sliding-window scoring of whole documents: every token scored exactly once, no window
crossing a document boundary.

A document of ``n`` tokens is framed as in training, ``[EOS] tokens [EOS]``
(:func:`longnet.data.encoding.frame_document`); input position ``p`` predicts token ``p + 1``,
so it has ``n + 1`` targets. Bits per byte divide the summed NLL by the document's UTF-8 bytes
(the EOS covers none), so models of any tokenizer compare on the same bytes.

Windows of length ``C`` end at ``C, C + S, C + 2S, ...`` (the last clipped to ``n + 1``); each
scores only the targets after the previous window's end, so outside the first window a target
sees at least ``C - S`` tokens of its document. ``S = C``: non-overlapping chunks (cheapest);
``S = 1``: full context for every target. Each window starts at position 0, as in training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from longnet.constants import NATS_PER_BIT
from longnet.data.encoding import frame_document
from longnet.data.tokenizer import EOS_ID, PAD_ID
from longnet.eval.documents import EvalDocument
from longnet.modeling import LongNetLM
from longnet.validation import check_positive_int

SCORED_ROWS = 4096
"""Scored positions whose logits exist at once (4,096 x 49,152 ids in float32: 0.8 GB)."""


@dataclass(frozen=True)
class Window:
    """Input positions ``[start, end)`` of framed document ``document``; the targets of input
    positions ``[score_from, end)`` are scored (``start <= score_from < end``)."""

    document: int
    start: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def num_scored(self) -> int:
        return self.end - self.score_from


@dataclass(frozen=True)
class SlidingWindowResult:
    """Totals of one sliding-window evaluation.

    Attributes:
        context_length, stride: the window and its step, in tokens.
        num_documents, num_bytes: documents and their UTF-8 bytes (EOS excluded).
        num_tokens: scored targets: the documents' tokens + one closing EOS each.
        nll_sum: summed negative log-likelihood of the scored targets, in nats.
        num_windows: forward passes (rows) run.
        longest_window: the longest window used (``< context_length`` for short documents).
        token_nll: with ``return_token_nll``, per document the ``(num_tokens + 1,)`` float64
            NLL of each target in nats; otherwise None.
        token_bytes: with ``return_token_nll`` and subword documents, per document the
            ``(num_tokens + 1,)`` UTF-8 bytes of each target (0 for the EOS); None for bytes.
    """

    context_length: int
    stride: int
    num_documents: int
    num_bytes: int
    num_tokens: int
    nll_sum: float
    num_windows: int
    longest_window: int
    token_nll: list[np.ndarray] | None = None
    token_bytes: list[np.ndarray] | None = None

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per document token (the EOS left out): 1 for bytes."""
        return self.num_bytes / max(self.num_tokens - self.num_documents, 1)

    @property
    def bits_per_byte(self) -> float:
        """Bits of all targets (EOS included) per document byte."""
        return self.nll_sum / NATS_PER_BIT / self.num_bytes

    @property
    def bits_per_token(self) -> float:
        """Mean bits per scored target (bytes and EOS)."""
        return self.nll_sum / NATS_PER_BIT / self.num_tokens

    @property
    def context_bytes(self) -> float:
        """The context length in bytes: ``context_length * bytes_per_token``."""
        return self.context_length * self.bytes_per_token

    @property
    def perplexity(self) -> float:
        """Per-token perplexity ``exp(nll_sum / num_tokens)``."""
        return math.exp(self.nll_sum / self.num_tokens)


def check_context_length(context_length: int, model: LongNetLM | None = None) -> int:
    """``context_length`` if it is a positive int the model can take, else ``ValueError``."""
    context_length = check_positive_int("context length", context_length)
    if model is not None and model.config.position_encoding == "learned":
        limit = model.config.max_positions
        if context_length > limit:
            raise ValueError(
                f"context length {context_length} is longer than possible for this model: it "
                f"has {limit} learned positions; use context lengths <= {limit}."
            )
    return context_length


def resolve_stride(context_length: int, stride: int | float | None) -> int:
    """The stride in tokens: None = ``context_length``; an int in ``[1, context_length]``; a
    float in ``(0, 1]`` = that fraction of the context (at least 1 token)."""
    if stride is None:
        return context_length
    if isinstance(stride, bool):
        raise ValueError(f"stride must be an int or a fraction, got {stride!r}.")
    if isinstance(stride, int):
        if not 1 <= stride <= context_length:
            raise ValueError(
                f"stride must be in [1, context length {context_length}] tokens, got {stride}; "
                "a larger stride would skip tokens."
            )
        return stride
    if isinstance(stride, float) and 0.0 < stride <= 1.0:
        return max(1, round(stride * context_length))
    raise ValueError(
        f"stride must be an int in [1, context length] or a fraction in (0, 1], got {stride!r}."
    )


def plan_windows(
    num_targets: int, context_length: int, stride: int, document: int = 0
) -> list[Window]:
    """The windows of one document with ``num_targets`` input positions (module docstring);
    their ``[score_from, end)`` ranges partition ``[0, num_targets)`` in order."""
    check_positive_int("num_targets", num_targets)
    check_context_length(context_length)
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride must be in [1, {context_length}], got {stride}.")
    windows = []
    end = min(context_length, num_targets)
    scored = 0
    while True:
        windows.append(Window(document, max(0, end - context_length), end, scored))
        if end == num_targets:
            return windows
        scored, end = end, min(end + stride, num_targets)


@torch.inference_mode()
def score_documents(
    model: LongNetLM,
    documents: Sequence[EvalDocument],
    context_length: int,
    stride: int | float | None = None,
    *,
    batch_size: int = 1,
    return_token_nll: bool = False,
    progress: bool | str = False,
) -> SlidingWindowResult:
    """Score every target of every document once with sliding windows (module docstring).

    Windows run longest first, ``batch_size`` at a time, right-padded (causal attention: the
    padding changes no score, so batching does not change the result).

    Args:
        model: a causal LM (eval mode is set here); inputs go to its device.
        documents: the documents in the model's tokens (``documents.tokenize_documents``).
        context_length: the window length ``C`` in tokens.
        stride: see :func:`resolve_stride` (default: ``C``).
        batch_size: windows per forward pass.
        return_token_nll: also return the per-target NLL arrays.
        progress: show a tqdm bar (a string is its description).

    Returns:
        The totals, accumulated in float64.
    """
    check_context_length(context_length, model)
    step = resolve_stride(context_length, stride)
    check_positive_int("batch_size", batch_size)
    if not documents:
        raise ValueError("documents is empty; give at least one document to score.")
    model.eval()
    device = next(model.parameters()).device
    eos = EOS_ID if model.config.eos_token_id is None else model.config.eos_token_id
    framed = [frame_document(doc.tokens, np.int64, eos) for doc in documents]
    _check_ids(framed, model.config.vocab_size)
    windows = [
        window
        for index, tokens in enumerate(framed)
        for window in plan_windows(len(tokens) - 1, context_length, step, index)
    ]
    windows.sort(key=lambda w: -w.length)
    token_nll = None
    if return_token_nll:
        token_nll = [np.full(len(tokens) - 1, np.nan) for tokens in framed]
    nll_sum, scored = 0.0, 0
    batches = range(0, len(windows), batch_size)
    desc = progress if isinstance(progress, str) else f"context {context_length}"
    for first in tqdm(batches, desc=desc, disable=not progress, unit="batch", leave=False):
        batch = windows[first:first + batch_size]
        for window, values in zip(batch, _score_batch(model, framed, batch, device)):
            nll_sum += float(values.sum())
            scored += len(values)
            if token_nll is not None:
                slot = token_nll[window.document][window.score_from:window.end]
                if not np.isnan(slot).all():
                    raise AssertionError(f"a target was scored twice in {window}")  # a bug
                slot[:] = values
    num_tokens = sum(doc.num_tokens for doc in documents) + len(documents)
    if scored != num_tokens:
        raise AssertionError(f"scored {scored} targets, expected {num_tokens}")
    token_bytes = None
    if return_token_nll and any(doc.token_bytes is not None for doc in documents):
        token_bytes = [np.append(doc.token_bytes if doc.token_bytes is not None
                                 else np.ones(doc.num_tokens, np.int64), 0)
                       for doc in documents]
    return SlidingWindowResult(
        context_length=context_length,
        stride=step,
        num_documents=len(documents),
        num_bytes=sum(doc.num_bytes for doc in documents),
        num_tokens=num_tokens,
        nll_sum=nll_sum,
        num_windows=len(windows),
        longest_window=max(w.length for w in windows),
        token_nll=token_nll,
        token_bytes=token_bytes,
    )


def _check_ids(framed: Sequence[np.ndarray], vocab_size: int) -> None:
    """Refuse token ids the model has no row for (documents of another tokenizer)."""
    largest = max(int(tokens.max()) for tokens in framed)
    if largest >= vocab_size:
        raise ValueError(
            f"the documents hold token id {largest} but the model has vocab_size {vocab_size}: "
            "they are in another tokenizer's tokens; tokenize them with the model's tokenizer "
            "(longnet.eval.tokenize_documents(documents, loaded.tokenizer))."
        )


def _score_batch(
    model: LongNetLM, framed: Sequence[np.ndarray], batch: Sequence[Window], device: torch.device
) -> list[np.ndarray]:
    """Per window, the float64 NLL ``(num_scored,)`` of its scored targets. The LM head runs on
    scored positions only, :data:`SCORED_ROWS` at a time, so a window's logits never exist
    whole."""
    length = max(w.length for w in batch)
    pad = PAD_ID if model.config.pad_token_id is None else model.config.pad_token_id
    inputs = np.full((len(batch), length), pad, dtype=np.int64)
    targets = np.zeros((len(batch), length), dtype=np.int64)
    scored = np.zeros((len(batch), length), dtype=bool)
    for row, w in enumerate(batch):
        tokens = framed[w.document]
        inputs[row, :w.length] = tokens[w.start:w.end]
        targets[row, :w.length] = tokens[w.start + 1:w.end + 1]
        scored[row, w.score_from - w.start:w.length] = True
    hidden = model.model(torch.from_numpy(inputs).to(device))
    mask = torch.from_numpy(scored).to(device)
    rows, wanted = hidden[mask], torch.from_numpy(targets).to(device)[mask]
    del hidden
    nll = torch.cat([
        _token_nll(model.lm_head(part), part_targets)
        for part, part_targets in zip(rows.split(SCORED_ROWS), wanted.split(SCORED_ROWS))
    ])
    nll = nll.double().cpu().numpy()
    counts = [w.num_scored for w in batch]
    return list(np.split(nll, np.cumsum(counts)[:-1]))


def _token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """``(rows,)`` cross-entropy of ``logits`` ``(rows, vocab)``, computed in float32 at least."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(compute), targets, reduction="none")
