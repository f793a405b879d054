"""Documents to tokens with a subword tokenizer, as ``datasets`` batched maps.

The byte path (``corpus._encode_batch``) encodes and describes a document in one map; a
subword tokenizer must first see which documents are kept and which are training documents
(a BPE is trained on those), so here the two steps are separate maps:

1. :func:`describe_documents`: per document its content hash (``doc_id``, of its UTF-8
   bytes, as for bytes, so the splits are the same whatever the tokenizer), its split and
   its UTF-8 length ``num_bytes``; documents shorter than ``min_document_bytes`` dropped;
2. :func:`encode_documents`: the tokenizer's ids (``tokens``) and the UTF-8 bytes each token
   covers (``token_bytes``, ``SubwordTokenizer.encode_documents``), with the tokens per
   second of that map (the data throughput).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, Features, Sequence, Value

from longnet.data.splits import document_hash, split_of
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import ByteTokenizer

TOKEN_BYTES_COLUMN = "token_bytes"


def kept_documents(batch: dict[str, list], val_fraction: float, test_fraction: float,
                   min_document_bytes: int) -> Iterator[tuple[str, np.ndarray, str, str]]:
    """``(text, UTF-8 bytes (n,) uint8, doc_id, split)`` of each document of a batch of rows
    ``text`` (and ``split``, else the hash split) with at least ``min_document_bytes`` bytes."""
    encoder = ByteTokenizer()
    given = batch["split"] if "split" in batch else [None] * len(batch["text"])
    for text, split in zip(batch["text"], given):
        data = encoder.encode_array(text or "")
        if len(data) < min_document_bytes:
            continue
        doc_id = document_hash(data)
        yield text or "", data, doc_id, split or split_of(doc_id, val_fraction, test_fraction)


def _describe_batch(batch: dict[str, list], val_fraction: float, test_fraction: float,
                    min_document_bytes: int) -> dict[str, list]:
    out: dict[str, list] = {"text": [], "doc_id": [], "split": [], "num_bytes": []}
    for text, data, doc_id, split in kept_documents(batch, val_fraction, test_fraction,
                                                    min_document_bytes):
        out["text"].append(text)
        out["doc_id"].append(doc_id)
        out["split"].append(split)
        out["num_bytes"].append(len(data))
    return out


def describe_documents(documents: Dataset, val_fraction: float, test_fraction: float,
                       min_document_bytes: int) -> Dataset:
    """``documents`` (column ``text``, optionally ``split``) as rows ``text``, ``doc_id``,
    ``split``, ``num_bytes``, in source order, short documents dropped."""
    return documents.map(
        _describe_batch, batched=True, remove_columns=documents.column_names,
        fn_kwargs={"val_fraction": val_fraction, "test_fraction": test_fraction,
                   "min_document_bytes": min_document_bytes},
        features=Features({"text": Value("string"), "doc_id": Value("string"),
                           "split": Value("string"), "num_bytes": Value("int64")}),
        desc="describe documents",
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
    """``documents`` with ``text`` replaced by ``tokens`` (int32) and ``token_bytes``
    (int32), and the tokens per second of the encoding."""
    started = time.perf_counter()
    encoded = documents.map(
        _encode_batch, batched=True, batch_size=256, remove_columns=["text"],
        fn_kwargs={"tokenizer": tokenizer},
        features=Features({"doc_id": Value("string"), "split": Value("string"),
                           "num_bytes": Value("int64"), "tokens": Sequence(Value("int32")),
                           TOKEN_BYTES_COLUMN: Sequence(Value("int32"))}),
        new_fingerprint=f"encode-{tokenizer.fingerprint}",  # no hashing of the tokenizer
        desc="encode documents",
    )
    seconds = time.perf_counter() - started
    total = int(pc.sum(pc.list_value_length(encoded.data.column("tokens"))).as_py() or 0)
    return encoded, total / max(seconds, 1e-9)
