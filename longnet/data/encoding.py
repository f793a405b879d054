"""Documents into samples: each document's split, its tokens, and the windows cut from them.

Splits: a document's BLAKE2b-64 digest, read as ``u`` in ``[0, 1)``, puts it in validation
when ``u < val_fraction``, test when ``u < val_fraction + test_fraction``, else train: the same
everywhere, duplicates share a split, and raising ``test_fraction`` moves no validation one.

Windows: a document is framed as ``[EOS] + tokens + [EOS]``. Training windows are cut every
``seq_len`` tokens from the stream of documents; evaluation windows stay inside one document,
the last one padded with ``PAD_ID``, so every byte is scored once. A :class:`Framing` gives the
ids and stored types; :data:`COUNT_FRAMING` cuts per-token byte counts the same way.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, Features, Value
from datasets import Sequence as SequenceFeature

from longnet.constants import IGNORE_INDEX
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import EOS_ID, PAD_ID, ByteTokenizer
from longnet.validation import is_real

SPLITS = ("train", "validation", "test")
TOKEN_BYTES_COLUMN = "token_bytes"
DOCUMENT_COLUMN = "document_ids"
LABEL_BYTES_COLUMN = "label_bytes"
"""Per label, the UTF-8 bytes its target token covers (stored for subword tokenizers only)."""


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raise ``ValueError`` unless both fractions are in (0, 1) and leave room for training."""
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not is_real(value) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {value!r}.")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"val_fraction + test_fraction must be < 1 so documents remain for training, got "
            f"{val_fraction} + {test_fraction}; lower them."
        )


def document_hash(tokens: np.ndarray) -> str:
    """16 hex digits of the BLAKE2b-64 digest of a document's ``(n,)`` uint8 tokens."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.uint8), digest_size=8).hexdigest()


def split_of(doc_hash: str, val_fraction: float, test_fraction: float) -> str:
    """The split (``"train"``, ``"validation"`` or ``"test"``) of a document by its hash."""
    u = int(doc_hash, 16) / 2.0**64
    if u < val_fraction:
        return "validation"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def _describe_batch(batch: dict[str, list], val_fraction: float, test_fraction: float,
                    min_document_bytes: int, text: bool) -> dict[str, list]:
    out: dict[str, list] = {"doc_id": [], "split": []}
    out |= {"text": [], "num_bytes": []} if text else {"tokens": []}
    encoder = ByteTokenizer()
    given = batch["split"] if "split" in batch else [None] * len(batch["text"])
    for document, split in zip(batch["text"], given):
        data = encoder.encode_array(document or "")
        if len(data) < min_document_bytes:
            continue
        doc_id = document_hash(data)
        out["doc_id"].append(doc_id)
        out["split"].append(split or split_of(doc_id, val_fraction, test_fraction))
        if text:
            out["text"].append(document or "")
            out["num_bytes"].append(len(data))
        else:
            out["tokens"].append(data)
    return out


def describe_documents(documents: Dataset, val_fraction: float, test_fraction: float,
                       min_document_bytes: int, text: bool = True) -> Dataset:
    """``documents`` (``text``, optional ``split``) as ``doc_id``, ``split`` and, with ``text``,
    ``text`` and ``num_bytes``, else uint8 ``tokens``; short documents dropped."""
    columns = ({"text": Value("string"), "num_bytes": Value("int64")} if text
               else {"tokens": SequenceFeature(Value("uint8"))})
    return documents.map(
        _describe_batch, batched=True, remove_columns=documents.column_names,
        fn_kwargs={"val_fraction": val_fraction, "test_fraction": test_fraction,
                   "min_document_bytes": min_document_bytes, "text": text},
        features=Features({"doc_id": Value("string"), "split": Value("string"), **columns}),
        desc="describe documents" if text else "encode documents",
    )


def split_texts(documents: Dataset, split: str, batch_size: int = 64) -> Iterator[str]:
    """The texts of ``split`` in ``documents`` (a :func:`describe_documents` result), in order."""
    rows = np.flatnonzero(np.asarray(documents["split"][:]) == split)
    part = documents.select(rows)
    for first in range(0, len(part), batch_size):
        yield from part[first:first + batch_size]["text"]


def _encode_batch(batch: dict[str, list], tokenizer: SubwordTokenizer) -> dict[str, list]:
    encoded = tokenizer.encode_documents(batch["text"])
    return {"tokens": [ids for ids, _ in encoded],
            TOKEN_BYTES_COLUMN: [counts for _, counts in encoded]}


def encode_documents(documents: Dataset, tokenizer: SubwordTokenizer) -> tuple[Dataset, float]:
    """``documents`` with int32 ``tokens`` and ``token_bytes``, and the tokens per second."""
    started = time.perf_counter()
    encoded = documents.map(
        _encode_batch, batched=True, batch_size=256, remove_columns=["text"],
        fn_kwargs={"tokenizer": tokenizer},
        features=Features({"doc_id": Value("string"), "split": Value("string"),
                           "num_bytes": Value("int64"), "tokens": SequenceFeature(Value("int32")),
                           TOKEN_BYTES_COLUMN: SequenceFeature(Value("int32"))}),
        new_fingerprint=f"encode-{tokenizer.fingerprint}",  # no hashing of the tokenizer
        desc="encode documents",
    )
    seconds = time.perf_counter() - started
    total = int(pc.sum(pc.list_value_length(encoded.data.column("tokens"))).as_py() or 0)
    return encoded, total / max(seconds, 1e-9)


@dataclass(frozen=True)
class Framing:
    """The EOS and padding ids and the numpy types of stored inputs and labels."""

    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    dtype: type = np.uint8
    label_dtype: type = np.int16


BYTE_FRAMING = Framing()
COUNT_FRAMING = Framing(eos_id=0, pad_id=0, dtype=np.int32, label_dtype=np.int32)
"""Framing of a stream of per-token byte counts: EOS and padding cover no byte."""


def subword_framing(tokenizer: SubwordTokenizer) -> Framing:
    """A subword tokenizer's framing: uint16 inputs when every id fits, else int32."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    return Framing(tokenizer.eos_id, tokenizer.pad_id, dtype, np.int32)


def frame_document(tokens: np.ndarray, dtype: np.dtype | type = np.uint8,
                   eos_id: int = EOS_ID) -> np.ndarray:
    """``[EOS] + tokens + [EOS]``: the one place the evaluation framing is written."""
    eos = np.array([eos_id], dtype=dtype)
    return np.concatenate([eos, np.asarray(tokens, dtype=dtype), eos])


def _cut(tokens: np.ndarray, seq_len: int, count: int,
         framing: Framing) -> tuple[np.ndarray, np.ndarray]:
    """``(count, seq_len)`` inputs and labels of windows ``seq_len + 1`` long, ``seq_len`` apart."""
    if count == 0:
        return (np.empty((0, seq_len), dtype=framing.dtype),
                np.empty((0, seq_len), dtype=framing.label_dtype))
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:count]
    return windows[:, :-1].astype(framing.dtype), windows[:, 1:].astype(framing.label_dtype)


def packed_windows(documents: Sequence[np.ndarray], seq_len: int,
                   framing: Framing = BYTE_FRAMING) -> tuple[np.ndarray, np.ndarray]:
    """Training windows cut from the stream ``[EOS] doc [EOS] doc ... [EOS]``.

    Args:
        documents: token arrays (``framing.dtype``), one per document, in stream order.
        seq_len: tokens per sample.
        framing: the EOS id and the stored types.

    Returns:
        ``(inputs, labels)``, each ``(n, seq_len)``, ``n = (stream_len - 1) // seq_len`` (may be 0).
    """
    eos = np.array([framing.eos_id], dtype=framing.dtype)
    stream = np.concatenate(
        [part for doc in documents for part in (eos, np.asarray(doc, framing.dtype))] + [eos])
    return _cut(stream, seq_len, (len(stream) - 1) // seq_len, framing)


def packed_document_windows(
    documents: Sequence[np.ndarray], seq_len: int, framing: Framing = BYTE_FRAMING
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows of whole framed documents back to back (as :func:`packed_windows`).

    Returns:
        ``(inputs, labels, document_ids)``, each ``(n, seq_len)``; ``document_ids`` (int32)
        number each window's documents (or pieces) from 0; a label whose target lies in the
        next document is ``IGNORE_INDEX``.
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
    """Evaluation windows of one ``(n_tokens,)`` document, framed, the last one padded
    (arguments as in :func:`packed_windows`).

    Returns:
        ``(inputs, labels, offsets)``: ``(k, seq_len)`` twice and ``(k,)`` offsets in the framed
        document, ``k = ceil((n_tokens + 1) / seq_len)``.
    """
    length = len(document) + 2
    count = -(-(length - 1) // seq_len)
    padding = np.full(count * seq_len + 1 - length, framing.pad_id, dtype=framing.dtype)
    framed = frame_document(document, framing.dtype, framing.eos_id)
    inputs, labels = _cut(np.concatenate([framed, padding]), seq_len, count, framing)
    offsets = np.arange(count, dtype=np.int64) * seq_len
    labels[offsets[:, None] + np.arange(1, seq_len + 1) >= length] = IGNORE_INDEX
    return inputs, labels, offsets


def _pack_batch(batch: dict[str, list], seq_len: int, pack_documents: bool,
                framing: Framing) -> dict[str, np.ndarray]:
    windows = packed_document_windows if pack_documents else packed_windows
    parts = windows(list(batch["tokens"]), seq_len, framing)
    out = {"input_ids": parts[0], "labels": parts[1]}
    if pack_documents:
        out[DOCUMENT_COLUMN] = parts[2]
    if TOKEN_BYTES_COLUMN in batch:
        counts = windows(list(batch[TOKEN_BYTES_COLUMN]), seq_len, COUNT_FRAMING)[1]
        out[LABEL_BYTES_COLUMN] = np.where(out["labels"] == IGNORE_INDEX, 0, counts)
    return out


def _document_batch(batch: dict[str, list], seq_len: int,
                    framing: Framing) -> dict[str, np.ndarray]:
    parts = [document_windows(tokens, seq_len, framing) for tokens in batch["tokens"]]
    counts = [len(offsets) for _, _, offsets in parts]
    out = {
        "input_ids": np.concatenate([inputs for inputs, _, _ in parts]),
        "labels": np.concatenate([labels for _, labels, _ in parts]),
        "doc_id": np.repeat(np.asarray(batch["doc_id"], dtype=object), counts),
        "offset": np.concatenate([offsets for _, _, offsets in parts]),
    }
    if TOKEN_BYTES_COLUMN in batch:
        label_bytes = np.concatenate([document_windows(values, seq_len, COUNT_FRAMING)[1]
                                      for values in batch[TOKEN_BYTES_COLUMN]])
        out[LABEL_BYTES_COLUMN] = np.where(out["labels"] == IGNORE_INDEX, 0, label_bytes)
    return out


def window_dataset(documents: Dataset, split: str, seq_len: int, framing: Framing,
                   pack_documents: bool = False) -> Dataset:
    """The windows of the numpy-format rows of ``split``: packed for ``"train"``, else each
    document's own with ``doc_id`` and ``offset``; ``label_bytes`` from ``token_bytes``."""
    train = split == "train"
    packs = train and pack_documents
    columns = {
        "input_ids": SequenceFeature(Value(np.dtype(framing.dtype).name), length=seq_len),
        "labels": SequenceFeature(Value(np.dtype(framing.label_dtype).name), length=seq_len),
    }
    if not train:
        columns |= {"doc_id": Value("string"), "offset": Value("int64")}
    if packs:
        columns[DOCUMENT_COLUMN] = SequenceFeature(Value("int32"), length=seq_len)
    if TOKEN_BYTES_COLUMN in documents.column_names:
        columns[LABEL_BYTES_COLUMN] = SequenceFeature(Value("int32"), length=seq_len)
    return documents.map(
        _pack_batch if train else _document_batch,
        batched=True,
        batch_size=None if train else 256,
        remove_columns=documents.column_names,
        fn_kwargs={"seq_len": seq_len, "framing": framing}
        | ({"pack_documents": packs} if train else {}),
        features=Features(columns),
        desc=f"{split} windows",
    )


def shifted_sample(
    tokens: np.ndarray, labelled: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """Cut ``seq_len + 1`` tokens into a shifted sample.

    Args:
        tokens: ``(seq_len + 1,)`` integer token ids.
        labelled: optional ``(seq_len,)`` bool mask; ``labels[t]`` is ``IGNORE_INDEX`` where it
            is False. None labels every position.

    Returns:
        ``{"input_ids": (seq_len,), "labels": (seq_len,)}``, both int64.
    """
    tokens = torch.tensor(np.asarray(tokens), dtype=torch.long)
    labels = tokens[1:].clone()
    if labelled is not None:
        labels[~torch.tensor(np.asarray(labelled), dtype=torch.bool)] = IGNORE_INDEX
    return {"input_ids": tokens[:-1], "labels": labels}
