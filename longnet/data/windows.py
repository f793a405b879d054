"""Cutting token streams into shifted windows of ``seq_len + 1`` tokens.

Every document is framed as ``[EOS] + bytes`` and ends with the next document's ``EOS`` (or a
final one), so the model always sees a document start after an EOS and learns to predict the
end of a document.

- Training windows are *packed*: the framed training documents are concatenated into one stream
  and cut every ``seq_len`` tokens into windows of ``seq_len + 1`` tokens (consecutive windows
  share one token, so every token after the first is a label exactly once). A trailing partial
  window is dropped; training windows are never padded and may span documents.
- With ``pack_documents``, the training stream is the framed documents ``[EOS] + bytes +
  [EOS]`` back to back, each window comes with ``document_ids`` (the window's documents and
  pieces of documents numbered from 0), and a label whose target begins the next document is
  ``IGNORE_INDEX``: every document is trained as if it were alone, as evaluation frames it.
- Evaluation windows never cross a document boundary: each framed document
  ``[EOS] + bytes + [EOS]`` is cut the same way on its own, and its last window is padded with
  ``PAD_ID`` inputs whose labels are ``IGNORE_INDEX``. Documents shorter than a window are thus
  padded, not skipped, so every byte of every evaluation document is scored exactly once.

Inputs are returned as uint8 and labels as int16 (compact on disk; the torch format of
``datasets`` hands them out as int64).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from longnet.constants import IGNORE_INDEX
from longnet.data.tokenizer import EOS_ID, PAD_ID


def frame_document(tokens: np.ndarray, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """``[EOS] + tokens + [EOS]``: one document as the model sees it, ``(len(tokens) + 2,)``
    of ``dtype``. The one place the evaluation framing is written (``document_windows`` and
    ``longnet.eval.sliding`` use it)."""
    eos = np.array([EOS_ID], dtype=dtype)
    return np.concatenate([eos, np.asarray(tokens, dtype=dtype), eos])


def _cut(tokens: np.ndarray, seq_len: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` windows of ``seq_len + 1`` tokens at stride ``seq_len``, split into
    ``(count, seq_len)`` inputs and shifted labels."""
    if count == 0:
        return np.empty((0, seq_len), dtype=np.uint8), np.empty((0, seq_len), dtype=np.int16)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:count]
    return windows[:, :-1].astype(np.uint8), windows[:, 1:].astype(np.int16)


def packed_windows(documents: Sequence[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Training windows packed from the concatenated framed documents.

    Args:
        documents: uint8 token arrays, one per document, in stream order.
        seq_len: tokens per sample.

    Returns:
        ``(inputs, labels)``, each ``(n, seq_len)`` with ``n = (stream_len - 1) // seq_len``
        (``n`` may be 0 when the documents are shorter than one window).
    """
    eos = np.array([EOS_ID], dtype=np.uint8)
    stream = np.concatenate([part for doc in documents for part in (eos, doc)] + [eos])
    return _cut(stream, seq_len, (len(stream) - 1) // seq_len)


def packed_document_windows(
    documents: Sequence[np.ndarray], seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows of whole framed documents packed back to back, with document ids.

    Args:
        documents: uint8 token arrays, one per document, in stream order.
        seq_len: tokens per sample.

    Returns:
        ``(inputs, labels, document_ids)``, each ``(n, seq_len)`` with ``n = (stream_len - 1)
        // seq_len`` for the stream of ``frame_document`` s. ``document_ids`` (int32) number
        the documents (or pieces of documents cut by the window) of each window from 0 in
        sequence order; a label whose target lies in the next document is ``IGNORE_INDEX``.
    """
    framed = [frame_document(doc) for doc in documents]
    stream = np.concatenate(framed) if framed else np.empty(0, dtype=np.uint8)
    count = max(len(stream) - 1, 0) // seq_len
    inputs, labels = _cut(stream, seq_len, count)
    if count == 0:
        return inputs, labels, np.empty((0, seq_len), dtype=np.int32)
    owner = np.repeat(np.arange(len(framed)), [len(part) for part in framed])
    owners = np.lib.stride_tricks.sliding_window_view(owner, seq_len + 1)[::seq_len][:count]
    labels[owners[:, 1:] != owners[:, :-1]] = IGNORE_INDEX
    document_ids = (owners[:, :-1] - owners[:, :1]).astype(np.int32)
    return inputs, labels, document_ids


def document_windows(
    document: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Evaluation windows of one framed document, the last one padded.

    Args:
        document: ``(n_bytes,)`` uint8 tokens of one document.
        seq_len: tokens per sample.

    Returns:
        ``(inputs, labels, offsets)``: ``(k, seq_len)`` inputs, ``(k, seq_len)`` labels and
        ``(k,)`` offsets of each window's first input token in the framed document
        ``[EOS] + document + [EOS]``, with ``k = ceil((n_bytes + 1) / seq_len)``.
    """
    length = len(document) + 2
    count = -(-(length - 1) // seq_len)
    padding = np.full(count * seq_len + 1 - length, PAD_ID, dtype=np.uint8)
    inputs, labels = _cut(np.concatenate([frame_document(document), padding]), seq_len, count)
    offsets = np.arange(count, dtype=np.int64) * seq_len
    labels[offsets[:, None] + np.arange(1, seq_len + 1) >= length] = IGNORE_INDEX
    return inputs, labels, offsets
