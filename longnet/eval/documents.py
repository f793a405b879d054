"""Held-out documents for evaluation, whole (not cut into windows).

A source's non-empty documents (first ``max_documents``, source order) are split by the hash of
their UTF-8 bytes (``longnet.data.encoding``), so ``split="test"`` gives exactly the documents
of ``LongDocumentDataModule(...).test_dataset`` with the same fractions, whatever the tokenizer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longnet.data.encoding import SPLITS, check_fractions, document_hash, split_of
from longnet.data.reading import load_documents
from longnet.data.sources import select_source
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import ByteTokenizer
from longnet.validation import check_non_negative_int, check_positive_int

EVAL_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in SPLITS},
    "held-out": ("validation", "test"),
    "all": SPLITS,
}


@dataclass(frozen=True)
class EvalDocument:
    """One document.

    Attributes:
        doc_id: BLAKE2b-64 hash of its bytes (the ``doc_id`` of the data layer's windows).
        tokens: ``(num_tokens,)`` ids: uint8 bytes, or a subword tokenizer's int64 ids.
        token_bytes: ``(num_tokens,)`` UTF-8 bytes each token covers; None for bytes (one).
        data: ``(num_bytes,)`` uint8 UTF-8 bytes of the text; None when ``tokens`` are them.
    """

    doc_id: str
    tokens: np.ndarray
    token_bytes: np.ndarray | None = None
    data: np.ndarray | None = None

    @property
    def utf8(self) -> np.ndarray:
        """``(num_bytes,)`` uint8: the document's UTF-8 bytes (what compressors read)."""
        return self.tokens if self.data is None else self.data

    @property
    def num_bytes(self) -> int:
        return int(self.utf8.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def tokenize_documents(documents: Sequence[EvalDocument],
                       tokenizer: ByteTokenizer | SubwordTokenizer) -> list[EvalDocument]:
    """``documents`` (bytes) in ``tokenizer``'s tokens, with the bytes each covers."""
    if isinstance(tokenizer, ByteTokenizer):
        return list(documents)
    texts = [doc.utf8.tobytes().decode("utf-8") for doc in documents]
    return [EvalDocument(doc.doc_id, ids, counts, doc.utf8)
            for doc, (ids, counts) in zip(documents, tokenizer.encode_documents(texts))]


def load_eval_documents(
    data_files: str | Sequence[str] | None = None,
    *,
    corpus: str | Sequence[str] | None = None,
    split: str = "test",
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    text_column: str = "text",
    max_documents: int | None = None,
    min_bytes: int = 0,
) -> list[EvalDocument]:
    """The documents of one split, in source order.

    Args:
        data_files: glob(s) of local text/json/parquet files; None = ``corpus``.
        corpus: offline corpus entries when ``data_files`` is None, as the data module's
            (e.g. ``["stdlib", "sympy==1.14.0"]``); None = the standard library.
        split: ``"train"``, ``"validation"``, ``"test"``, ``"held-out"`` (validation + test)
            or ``"all"``.
        val_fraction, test_fraction: the hash-split fractions (as in the data module).
        text_column: the text column of json/parquet rows.
        max_documents: keep the first non-empty documents of the source (before splitting).
        min_bytes: then drop documents shorter than this many bytes.

    Raises:
        ValueError: a bad argument, or no document left.
        UsageError: a ``corpus`` distribution not installed, not pinned or modified.
    """
    if split not in EVAL_SPLITS:
        raise ValueError(f"split must be one of {list(EVAL_SPLITS)}, got {split!r}.")
    check_fractions(val_fraction, test_fraction)
    if max_documents is not None:
        check_positive_int("max_documents", max_documents)
    check_non_negative_int("min_bytes", min_bytes)
    source = select_source(data_files, corpus, text_column)
    tokenizer = ByteTokenizer()
    documents: list[EvalDocument] = []
    kept = 0
    with tempfile.TemporaryDirectory(prefix="longnet-eval-") as scratch:
        texts = load_documents(source, Path(scratch))
        for text in texts["text"]:
            tokens = tokenizer.encode_array(text or "")
            if len(tokens) == 0:
                continue
            kept += 1
            if max_documents is not None and kept > max_documents:
                break
            doc_id = document_hash(tokens)
            if split_of(doc_id, val_fraction, test_fraction) not in EVAL_SPLITS[split]:
                continue
            if len(tokens) >= min_bytes:
                documents.append(EvalDocument(doc_id=doc_id, tokens=tokens.copy()))
    if not documents:
        which = "" if split == "all" else f"{split} "
        raise ValueError(
            f"no {which}document in the {source.name} corpus ({kept} non-empty documents read, "
            f"val_fraction={val_fraction}, test_fraction={test_fraction}, "
            f"min_bytes={min_bytes}); lower min_bytes or give more data_files."
        )
    return documents
