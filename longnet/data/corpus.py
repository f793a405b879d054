"""Long-document corpora processed into windows with ``datasets`` and cached on disk.

:func:`build_long_document_splits` reads and describes the documents (``encoding``), keeps the
first up to the limits, trains or loads a BPE on the training documents when one is asked for,
cuts each split into windows and saves them in a cache entry (``cache``), memory-mapped later.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, load_from_disk

from longnet.data.cache import build_once, cache_folder, fingerprint
from longnet.data.compressors import compressor_baselines
from longnet.data.encoding import (
    BYTE_FRAMING,
    DOCUMENT_COLUMN,
    LABEL_BYTES_COLUMN,
    SPLITS,
    check_fractions,
    describe_documents,
    encode_documents,
    split_texts,
    subword_framing,
    window_dataset,
)
from longnet.data.reading import DocumentSource
from longnet.data.subword import SubwordTokenizer, check_round_trip
from longnet.data.tokenizer import (
    BYTES,
    ByteTokenizer,
    TokenizerChoice,
    Tokenizers,
    parse_tokenizer,
)
from longnet.validation import UsageError, check_positive_int

CORPUS_FORMAT_VERSION = 1
SAMPLE_COLUMNS = ["input_ids", "labels"]


@dataclass(frozen=True)
class CorpusSettings:
    """Processing settings; every field is part of the cache key.

    Attributes:
        seq_len: tokens per sample (windows hold ``seq_len + 1`` tokens).
        val_fraction, test_fraction: expected shares of documents in validation and test.
        max_documents: keep at most this many (non-empty) documents, in source order.
        max_bytes: stop keeping documents once their bytes reach this many.
        min_document_bytes: drop documents shorter than this many bytes.
        pack_documents: training windows of whole documents with their ``document_ids``.
    """

    seq_len: int
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    max_documents: int | None = None
    max_bytes: int | None = None
    min_document_bytes: int = 1
    pack_documents: bool = False

    def __post_init__(self) -> None:
        # NumPy numbers are stored as Python ones, which the cache key's JSON holds
        set_field = functools.partial(object.__setattr__, self)
        set_field("seq_len", check_positive_int("seq_len", self.seq_len))
        if not isinstance(self.pack_documents, bool):
            raise ValueError(f"pack_documents must be True or False, got {self.pack_documents!r}.")
        set_field("min_document_bytes",
                  check_positive_int("min_document_bytes", self.min_document_bytes))
        check_fractions(self.val_fraction, self.test_fraction)
        set_field("val_fraction", float(self.val_fraction))
        set_field("test_fraction", float(self.test_fraction))
        for name in ("max_documents", "max_bytes"):
            if getattr(self, name) is not None:
                set_field(name, check_positive_int(name, getattr(self, name)))


@dataclass(frozen=True)
class LongDocumentSplits:
    """The processed corpus.

    Attributes:
        train: packed windows, torch format ``{"input_ids", "labels"}`` each ``(seq_len,)``.
        validation, test: windows inside one document each, same format; the hidden columns
            ``doc_id`` and ``offset`` are read through ``.with_format(None)``.
        documents: per kept document ``doc_id``, ``split``, ``num_bytes`` (``num_tokens``).
        path: the cache entry.
        built: True when this call processed the data, False when it loaded the cache.
        tokenizer: the tokenizer of the windows.
        gzip_bits_per_byte: gzip -9's on ``"validation"`` and ``"test"`` (:func:`held_out_gzip`).
    """

    train: Dataset
    validation: Dataset
    test: Dataset
    documents: Dataset
    path: Path
    built: bool
    tokenizer: Tokenizers = field(default_factory=ByteTokenizer)
    gzip_bits_per_byte: dict[str, float] = field(default_factory=dict)


def corpus_cache_key(source: DocumentSource, settings: CorpusSettings,
                     tokenizer: TokenizerChoice | None = None) -> str:
    """The cache key of ``source`` processed with ``settings`` and ``tokenizer``; bytes and
    ``pack_documents=False`` are left out of the key, so older entries keep theirs."""
    fields = asdict(settings)
    if not settings.pack_documents:
        del fields["pack_documents"]
    extra = {} if tokenizer is None or tokenizer.kind == BYTES else \
        {"tokenizer": _tokenizer_key(source, settings, tokenizer)}
    return fingerprint({
        "version": CORPUS_FORMAT_VERSION, **source.cache_fields(), "settings": fields, **extra,
    })


def _bpe_key(source: DocumentSource, settings: CorpusSettings) -> dict:
    """What a BPE trained on the training split depends on (not the window length)."""
    chosen = {name: getattr(settings, name) for name in (
        "val_fraction", "test_fraction", "max_documents", "max_bytes", "min_document_bytes")}
    return {"source": source.name, **source.cache_fields(), "documents": chosen}


def _tokenizer_key(source: DocumentSource, settings: CorpusSettings,
                   tokenizer: TokenizerChoice) -> dict:
    """The tokenizer's part of the corpus key: its fingerprint, or a BPE's size and data."""
    if tokenizer.loaded is not None:
        return {"fingerprint": tokenizer.loaded.fingerprint}
    return {"bpe": tokenizer.bpe_vocab_size, "on": fingerprint(_bpe_key(source, settings))}


def _documents_kept(num_bytes: np.ndarray, settings: CorpusSettings) -> int:
    count = len(num_bytes)
    if settings.max_documents is not None:
        count = min(count, settings.max_documents)
    if settings.max_bytes is not None:
        reached = np.flatnonzero(np.cumsum(num_bytes[:count]) >= settings.max_bytes)
        if reached.size:
            count = int(reached[0]) + 1
    return count


def documents_needed(val_fraction: float, test_fraction: float, chance: float = 0.95) -> int:
    """How many documents give every split one with probability ``chance``."""
    smallest = min(val_fraction, test_fraction)
    return max(3, math.ceil(math.log((1 - chance) / 2) / math.log1p(-smallest)))


def _check_splits(source: DocumentSource, settings: CorpusSettings, split_column: np.ndarray,
                  available: int) -> None:
    kept = len(split_column)
    files = (f"{len(source.files)} files under {os.path.commonpath(source.files)}"
             if len(source.files) > 3 else ", ".join(str(path) for path in source.files))
    if kept == 0:
        raise UsageError(
            f"{source.name} corpus: no document of at least {settings.min_document_bytes} bytes "
            f"in {files} (empty files are skipped); point data_files at files with text or "
            "lower min_document_bytes."
        )
    empty = [split for split in SPLITS if not np.any(split_column == split)]
    if not empty:
        return
    needed = documents_needed(settings.val_fraction, settings.test_fraction)
    limited = (f" (max_documents/max_bytes kept {kept} of {available}; raise them)"
               if kept < available else "")
    splits = " and ".join(f"the {split} split" for split in empty)
    raise UsageError(
        f"{source.name} corpus: no document for {splits}: {kept} document"
        f"{'s' if kept != 1 else ''} from {files}{limited}. Documents go "
        "whole into one split, by a hash of their content, so a corpus needs at least 3 "
        f"documents and about {needed} for every split to get one (val_fraction="
        f"{settings.val_fraction}, test_fraction={settings.test_fraction}). Give more "
        "documents (e.g. cut one large file into one file per chapter or section) or raise "
        "val_fraction/test_fraction."
    )


def _build(source: DocumentSource, settings: CorpusSettings, staging: Path,
           choice: TokenizerChoice) -> None:
    subword = choice.kind != BYTES
    documents = describe_documents(source.read_documents(staging / "hf"), settings.val_fraction,
                                   settings.test_fraction, settings.min_document_bytes, subword)
    num_bytes = (np.asarray(documents["num_bytes"][:], dtype=np.int64) if subword
                 else pc.list_value_length(documents.data.column("tokens")).to_numpy())
    documents = documents.select(range(_documents_kept(num_bytes, settings)))
    _check_splits(source, settings, np.asarray(documents["split"][:]), available=len(num_bytes))
    source_documents = documents  # the text, before a subword tokenizer encodes it
    info: dict = {}
    framing = BYTE_FRAMING
    if subword:
        tokenizer = choice.resolve(lambda: split_texts(documents, "train"),
                                   _bpe_key(source, settings), staging.parent)
        check_round_trip(tokenizer, round_trip_sample(documents))
        documents, tokens_per_s = encode_documents(documents, tokenizer)
        framing = subword_framing(tokenizer)
        info["tokenizer"] = {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                             "tokens_per_s": round(tokens_per_s)}
    split_column = np.asarray(documents["split"][:])
    info["gzip_bits_per_byte"] = held_out_gzip(source_documents, split_column)
    counts = {}
    for split in SPLITS:
        part = documents.select(np.flatnonzero(split_column == split)).with_format("numpy")
        counts[split] = len(part)
        windows = window_dataset(part, split, settings.seq_len, framing, settings.pack_documents)
        if len(windows) == 0:
            raise UsageError(
                f"{source.name} corpus: the train split's {counts[split]} documents make no "
                f"window of seq_len + 1 = {settings.seq_len + 1} tokens; lower seq_len or "
                "raise max_documents/max_bytes."
            )
        windows.save_to_disk(str(staging / split))
    index = documents.select_columns(["doc_id", "split"])
    index = index.add_column("num_bytes", num_bytes[:len(documents)])
    if subword:
        index = index.add_column(
            "num_tokens", pc.list_value_length(documents.data.column("tokens")).to_numpy())
    index.save_to_disk(str(staging / "documents"))
    info = {"source": source.name, "format": source.format, "files": len(source.files),
            "settings": asdict(settings), "documents": counts, **info}
    (staging / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(staging / "hf")  # intermediate arrow files are not part of the entry


ROUND_TRIP_DOCUMENTS = 16
ROUND_TRIP_CHARACTERS = 4096
"""How many training documents, and characters of each, a subword tokenizer must give back."""


def round_trip_sample(documents: Dataset) -> list[tuple[str, str]]:
    """``(what, text)`` of training documents, evenly spread, cut for the round trip."""
    rows = np.flatnonzero(np.asarray(documents["split"][:]) == "train")
    picked = np.unique(np.linspace(0, len(rows) - 1, min(len(rows), ROUND_TRIP_DOCUMENTS))
                       .round().astype(np.int64)) if len(rows) else rows
    sample = documents.select(rows[picked])
    return [(f"training document {index} (doc_id {doc_id})", text[:ROUND_TRIP_CHARACTERS])
            for index, doc_id, text in zip(picked.tolist(), sample["doc_id"], sample["text"])]


def held_out_gzip(source_documents: Dataset, split_column: np.ndarray) -> dict[str, float]:
    """gzip -9's bits per byte on the validation and test documents, each alone."""
    column = "text" if "text" in source_documents.column_names else "tokens"
    scores = {}
    for split in SPLITS[1:]:
        part = source_documents.select(np.flatnonzero(split_column == split))
        rows = part.with_format("numpy" if column == "tokens" else None)[column]
        blobs = [row.encode("utf-8") if isinstance(row, str) else row for row in rows]
        if sum(map(len, blobs)):
            scores[split] = compressor_baselines(blobs, ["separate"], ["gzip"])[0].bits_per_byte
    return scores


def _build_logged(source: DocumentSource, settings: CorpusSettings, staging: Path,
                  choice: TokenizerChoice) -> None:
    """``_build``, with ``datasets``' progress bars only on a terminal (else two log lines)."""
    if sys.stderr.isatty() or not datasets.is_progress_bar_enabled():
        _build(source, settings, staging, choice)
        return
    print(f"Building the {source.name} corpus ({len(source.files)} files) in {staging.parent}.",
          file=sys.stderr, flush=True)
    datasets.disable_progress_bars()
    started = time.perf_counter()
    try:
        _build(source, settings, staging, choice)
    finally:
        datasets.enable_progress_bars()
    print(f"Built the {source.name} corpus in {time.perf_counter() - started:.0f} s.",
          file=sys.stderr, flush=True)


def build_long_document_splits(
    source: DocumentSource, settings: CorpusSettings, cache_dir: str | Path,
    tokenizer: TokenizerChoice | str | None = None,
) -> LongDocumentSplits:
    """Process ``source`` into train/validation/test windows, or load them from the cache.

    The cache entry ``<cache_dir>/<source.name>-<corpus_cache_key>`` is rebuilt when the files
    (list, sizes, mtimes), the settings or the tokenizer change.

    Args:
        tokenizer: a :class:`~longnet.data.tokenizer.TokenizerChoice` or the option it
            parses; None is bytes. Subword windows also hold ``label_bytes``.

    Raises:
        UsageError: unreadable documents, no document, a split without one, no full training
            window, or a damaged cache entry.
    """
    choice = tokenizer if isinstance(tokenizer, TokenizerChoice) else parse_tokenizer(tokenizer)
    folder = cache_folder(cache_dir)
    entry = folder / f"{source.name}-{corpus_cache_key(source, settings, choice)}"
    built = build_once(entry, lambda staging: _build_logged(source, settings, staging, choice))
    splits = {name: _load_entry_part(entry, name) for name in (*SPLITS, "documents")}
    for split in SPLITS:
        extra = [column for column in (DOCUMENT_COLUMN, LABEL_BYTES_COLUMN)
                 if column in splits[split].column_names]
        splits[split].set_format("torch", columns=SAMPLE_COLUMNS + extra)
    loaded = choice.resolve(lambda: _training_texts(source, settings), _bpe_key(source, settings),
                            folder)
    if choice.kind != BYTES:
        _check_entry_tokenizer(entry, loaded)
    gzip = json.loads((entry / "info.json").read_text()).get("gzip_bits_per_byte", {})
    return LongDocumentSplits(path=entry, built=built, tokenizer=loaded,
                              gzip_bits_per_byte=gzip, **splits)


def _check_entry_tokenizer(entry: Path, tokenizer: SubwordTokenizer) -> None:
    """Refuse a corpus entry built by another tokenizer (one changed in place, same name)."""
    recorded = json.loads((entry / "info.json").read_text()).get("tokenizer", {})
    if recorded.get("fingerprint") != tokenizer.fingerprint:
        raise UsageError(
            f"the corpus cache entry {entry} was built with tokenizer {recorded.get('name')} of "
            f"fingerprint {recorded.get('fingerprint')}, but {tokenizer.name} now has "
            f"{tokenizer.fingerprint}; delete the entry (rm -r {entry}) and run again to "
            "rebuild it with this tokenizer."
        )


def _training_texts(source: DocumentSource, settings: CorpusSettings) -> Iterator[str]:
    """The training texts, read again (a BPE entry deleted while its corpus entry stayed)."""
    with tempfile.TemporaryDirectory(prefix="longnet-bpe-") as scratch:
        documents = describe_documents(source.read_documents(Path(scratch)),
                                       settings.val_fraction, settings.test_fraction,
                                       settings.min_document_bytes)
        num_bytes = np.asarray(documents["num_bytes"][:], dtype=np.int64)
        yield from split_texts(documents.select(range(_documents_kept(num_bytes, settings))),
                               "train")


def _load_entry_part(entry: Path, name: str) -> Dataset:
    try:
        return load_from_disk(str(entry / name))
    except (OSError, ValueError) as err:  # a file deleted or cut short (pyarrow: ValueError)
        raise UsageError(
            f"the corpus cache entry {entry} is damaged ({name}: {type(err).__name__}: {err}); "
            f"delete it (rm -r {entry}) and run again to rebuild it."
        ) from None
