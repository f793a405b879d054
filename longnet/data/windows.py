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

Inputs are returned as uint8 and labels as int16 for bytes (compact on disk; the torch format
of ``datasets`` hands them out as int64); a :class:`Framing` gives another tokenizer's EOS and
padding ids and wider types. The same functions cut a stream of per-token byte counts
(``Framing(0, 0, ...)``) into the windows' ``label_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longnet.constants import IGNORE_INDEX
from longnet.data.tokenizer import EOS_ID, PAD_ID


@dataclass(frozen=True)
class Framing:
    """How documents are framed and stored: the EOS and padding ids, the numpy types of
    inputs and labels."""

    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    dtype: type = np.uint8
    label_dtype: type = np.int16


BYTE_FRAMING = Framing()


def frame_document(tokens: np.ndarray, dtype: np.dtype | type = np.uint8,
                   eos_id: int = EOS_ID) -> np.ndarray:
    """``[EOS] + tokens + [EOS]``: one document as the model sees it, ``(len(tokens) + 2,)``
    of ``dtype``. The one place the evaluation framing is written (``document_windows`` and
    ``longnet.eval.sliding`` use it)."""
    eos = np.array([eos_id], dtype=dtype)
    return np.concatenate([eos, np.asarray(tokens, dtype=dtype), eos])


def _cut(tokens: np.ndarray, seq_len: int, count: int,
         framing: Framing) -> tuple[np.ndarray, np.ndarray]:
    """``count`` windows of ``seq_len + 1`` tokens at stride ``seq_len``, split into
    ``(count, seq_len)`` inputs and shifted labels."""
    if count == 0:
        return (np.empty((0, seq_len), dtype=framing.dtype),
                np.empty((0, seq_len), dtype=framing.label_dtype))
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:count]
    return windows[:, :-1].astype(framing.dtype), windows[:, 1:].astype(framing.label_dtype)


def packed_windows(documents: Sequence[np.ndarray], seq_len: int,
                   framing: Framing = BYTE_FRAMING) -> tuple[np.ndarray, np.ndarray]:
    """Training windows packed from the concatenated framed documents.

    Args:
        documents: token arrays (``framing.dtype``), one per document, in stream order.
        seq_len: tokens per sample.
        framing: the EOS id and the stored types (bytes by default).

    Returns:
        ``(inputs, labels)``, each ``(n, seq_len)`` with ``n = (stream_len - 1) // seq_len``
        (``n`` may be 0 when the documents are shorter than one window).
    """
    eos = np.array([framing.eos_id], dtype=framing.dtype)
    stream = np.concatenate(
        [part for doc in documents for part in (eos, np.asarray(doc, framing.dtype))] + [eos])
    return _cut(stream, seq_len, (len(stream) - 1) // seq_len, framing)


def packed_document_windows(
    documents: Sequence[np.ndarray], seq_len: int, framing: Framing = BYTE_FRAMING
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows of whole framed documents packed back to back, with document ids.

    Args:
        documents: token arrays (``framing.dtype``), one per document, in stream order.
        seq_len: tokens per sample.

    Returns:
        ``(inputs, labels, document_ids)``, each ``(n, seq_len)`` with ``n = (stream_len - 1)
        // seq_len`` for the stream of ``frame_document`` s. ``document_ids`` (int32) number
        the documents (or pieces of documents cut by the window) of each window from 0 in
        sequence order; a label whose target lies in the next document is ``IGNORE_INDEX``.
    """
    framed = [frame_document(doc, framing.dtype, framing.eos_id) for doc in documents]
    stream = np.concatenate(framed) if framed else np.empty(0, dtype=framing.dtype)
    count = max(len(stream) - 1, 0) // seq_len
    inputs, labels = _cut(stream, seq_len, count, framing)
    if count == 0:
        return inputs, labels, np.empty((0, seq_len), dtype=np.int32)
    owner = np.repeat(np.arange(len(framed)), [len(part) for part in framed])
    owners = np.lib.stride_tricks.sliding_window_view(owner, seq_len + 1)[::seq_len][:count]
    labels[owners[:, 1:] != owners[:, :-1]] = IGNORE_INDEX
    document_ids = (owners[:, :-1] - owners[:, :1]).astype(np.int32)
    return inputs, labels, document_ids


def document_windows(
    document: np.ndarray, seq_len: int, framing: Framing = BYTE_FRAMING
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Evaluation windows of one framed document, the last one padded.

    Args:
        document: ``(n_tokens,)`` tokens of one document; ``framing``: as in ``packed_windows``.
        seq_len: tokens per sample.

    Returns:
        ``(inputs, labels, offsets)``: ``(k, seq_len)`` inputs, ``(k, seq_len)`` labels and
        ``(k,)`` offsets of each window's first input token in the framed document
        ``[EOS] + document + [EOS]``, with ``k = ceil((n_tokens + 1) / seq_len)``.
    """
    length = len(document) + 2
    count = -(-(length - 1) // seq_len)
    padding = np.full(count * seq_len + 1 - length, framing.pad_id, dtype=framing.dtype)
    framed = frame_document(document, framing.dtype, framing.eos_id)
    inputs, labels = _cut(np.concatenate([framed, padding]), seq_len, count, framing)
    offsets = np.arange(count, dtype=np.int64) * seq_len
    labels[offsets[:, None] + np.arange(1, seq_len + 1) >= length] = IGNORE_INDEX
    return inputs, labels, offsets
