"""``LongDocumentDataModule``: causal-LM windows of long documents, optionally mixed with
passkey examples."""

from __future__ import annotations

import lightning as L
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from longnet.data.cache import cache_folder
from longnet.data.corpus import CorpusSettings, LongDocumentSplits, build_long_document_splits
from longnet.data.loaders import check_loader_args, make_loader
from longnet.data.passkey import LabelMode, PasskeyDataset, check_passkey_options
from longnet.data.repositories import check_package_options, repository_source
from longnet.data.sources import InvalidFiles, select_source
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer_choice import BYTES, Tokenizers, parse_tokenizer
from longnet.validation import UsageError


class LongDocumentDataModule(L.LightningDataModule):
    """Windows of long documents in tokens of a chosen tokenizer, bytes by default (see
    ``data/README.md`` for the recipe).

    Samples are ``{"input_ids": (seq_len,), "labels": (seq_len,)}`` int64 with shifted labels;
    batches stack them to ``(batch_size, seq_len)``. Training windows are packed across
    documents and shuffled; validation/test windows lie inside one document each, the last
    window of a document padded (labels ``-100``), in document order. With
    ``pack_documents`` training samples also hold ``"document_ids"`` ``(seq_len,)``; with a
    subword tokenizer every sample also holds ``"label_bytes"`` ``(seq_len,)``: the UTF-8
    bytes of the text each label's token covers (0 where none), what bits per byte divide by.

    Args:
        seq_len: tokens per sample.
        batch_size: samples per training batch.
        data_files: glob(s) of local files (``sources.files_source``): text, or tables
            (json/jsonl, parquet, csv, tsv) whose ``text_column`` rows are documents;
            None uses ``corpus``.
        corpus: the offline corpus when ``data_files`` is None: one entry or a list, read in
            that order, one document per ``*.py`` file: ``"stdlib"`` (the running Python's
            standard library) and installed distributions, pinned as ``"sympy==1.14.0"``
            (``longnet.data.corpus_source``). None (the default) is ``"stdlib"``, unchanged:
            the same documents, splits and cache entry as ``corpus="stdlib"``. Setting both
            ``data_files`` and ``corpus`` is an error.
        text_column: column holding the text in table rows (json, parquet, csv, tsv).
        invalid_files: text ``data_files`` that are binary or not UTF-8 are refused
            (``"error"``, naming them) or left out with a warning (``"skip"``).
        val_fraction, test_fraction: expected shares of documents held out (hash split).
        max_documents, max_bytes: keep only the first documents (source order) to bound size.
        min_document_bytes: drop documents shorter than this (all splits), e.g. 16384 to train
            and validate a long-context model on long documents only.
        passkey_fraction: share in ``[0, 1)`` of training samples that are passkey examples
            (drawn on the fly from ``seed``, in the tokenizer's tokens: ``seq_len`` must hold
            the shortest, ``min_passkey_length`` bytes or ``min_passkey_tokens`` tokens);
            validation and test stay pure text.
        passkey_label_mode: ``"all"`` (language modelling on the whole passkey text),
            ``"answer"`` (loss on the key's digits only) or ``"recall"`` (the answer and the
            needle's second copy of the key; ``PasskeyDataset``) for the mixed-in examples.
        seed: seed of the mixed-in passkey examples.
        cache_dir: where processed corpora are cached (``~`` expanded; an empty string is
            refused); None is the user cache folder: ``$LONGNET_CACHE``, else
            ``$XDG_CACHE_HOME/longnet`` or ``~/.cache/longnet`` (``cache.default_cache_dir``).
        num_workers: DataLoader worker processes.
        eval_batch_size: samples per validation/test batch; None uses ``batch_size``.
        pack_documents: training windows hold whole framed documents (``[EOS] + bytes +
            [EOS]``, as evaluation frames them) back to back, long ones cut into pieces by the
            window, with ``document_ids`` numbering each window's documents: the model attends
            within each document only, positions restart at each, and no label crosses into
            the next (docs/training.md, "Packed documents"). False (default): the plain packed
            stream, unchanged. Not with ``passkey_fraction``.
        packages: the repository-level code corpus instead of ``corpus``/``data_files``: one
            document per package, its ``*.py`` files one after another, each after a line
            ``# file: <path>``; entries ``"stdlib"`` (its top-level modules and packages),
            ``"installed"`` (every distribution installed from a wheel), ``"<distribution>"``
            or ``"<distribution>==<version>"`` (``longnet.data.repositories``). A package goes
            whole into the split its name hashes to (``val_fraction``/``test_fraction``).
        held_out: with ``packages``, the held-out packages instead of the hash:
            ``{"validation": [...], "test": [...]}``, every other package in train.
        tokenizer: ``"bytes"`` (default: one token per UTF-8 byte, vocabulary 256),
            ``"bpe:<vocab size>"`` (a byte-level BPE trained on the training split with the
            ``tokenizers`` library, cached), a ``tokenizer.json`` path, a Hugging Face
            tokenizer folder, or a model folder or zoo name (its tokenizer files, read with
            ``AutoTokenizer`` offline); ``longnet.data.tokenizer_choice``. The model takes its
            ``vocab_size`` and special ids from it (:attr:`vocab_size`, :attr:`eos_id`,
            :attr:`pad_id`); :attr:`tokenizer` is the tokenizer itself after ``setup``.

    Raises:
        FileNotFoundError: a ``data_files`` pattern matches nothing (raised here, before work).
        ValueError: an argument is out of range or a ``corpus`` entry is malformed (the message
            names it); with a BPE to train, a ``seq_len`` too short for its passkey examples
            is found in ``setup``.
        UsageError: (here) a ``corpus`` distribution that is not installed, not the pinned
            version, or modified since it was installed (files that differ from its RECORD);
            a ``tokenizer`` that is not one (``tokenizer_choice.parse_tokenizer``).
        UsageError: (in ``prepare_data``/``setup``) data that cannot be used: files that are
            not UTF-8 text, no document, a corpus too small to split (see
            ``build_long_document_splits``).
    """

    def __init__(
        self,
        seq_len: int = 1024,
        batch_size: int = 8,
        data_files: str | list[str] | None = None,
        corpus: str | list[str] | None = None,
        text_column: str = "text",
        invalid_files: InvalidFiles = "error",
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_documents: int | None = None,
        max_bytes: int | None = None,
        min_document_bytes: int = 1,
        passkey_fraction: float = 0.0,
        passkey_label_mode: LabelMode = "all",
        seed: int = 0,
        cache_dir: str | None = None,
        num_workers: int = 0,
        eval_batch_size: int | None = None,
        pack_documents: bool = False,
        packages: str | list[str] | None = None,
        held_out: dict[str, list[str]] | None = None,
        tokenizer: str = BYTES,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.settings = CorpusSettings(
            seq_len=seq_len,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            max_documents=max_documents,
            max_bytes=max_bytes,
            min_document_bytes=min_document_bytes,
            pack_documents=pack_documents,
        )
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.num_workers = num_workers
        check_loader_args(batch_size, num_workers)
        check_loader_args(self.eval_batch_size, num_workers)
        if not 0.0 <= passkey_fraction < 1.0:
            raise ValueError(f"passkey_fraction must be in [0, 1), got {passkey_fraction!r}.")
        if passkey_fraction > 0 and pack_documents:
            raise ValueError(
                "pack_documents cannot be combined with passkey_fraction > 0 yet (passkey "
                "samples have no document_ids); set one of them off."
            )
        if passkey_fraction > 0:  # seq_len: below, in the tokenizer's tokens
            check_passkey_options(passkey_label_mode, seed=seed)
        self.passkey_fraction, self.passkey_label_mode, self.seed = (
            passkey_fraction, passkey_label_mode, seed
        )
        check_package_options(packages, held_out, data_files, corpus)
        self.source = (
            select_source(data_files, corpus, text_column, invalid_files) if packages is None
            else repository_source(packages, held_out, val_fraction, test_fraction)
        )
        self.cache_dir = cache_folder(cache_dir)
        self.tokenizer_choice = parse_tokenizer(tokenizer)
        if passkey_fraction > 0 and self.tokenizer_choice.loaded is not None:  # a BPE: setup
            PasskeyDataset(seq_len, 0, seed=seed, label_mode=passkey_label_mode,
                           tokenizer=self._passkey_tokenizer(self.tokenizer_choice.loaded))
        self.tokenizer: Tokenizers | None = self.tokenizer_choice.loaded
        self.splits: LongDocumentSplits | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: 256 for bytes, the BPE's size asked, else the tokenizer's."""
        return self.tokenizer_choice.vocab_size

    @property
    def eos_id(self) -> int:
        """The id that frames every document (end of document)."""
        return self.tokenizer_choice.eos_id

    @property
    def pad_id(self) -> int:
        """The id that pads evaluation windows (labels ignored there)."""
        return self.tokenizer_choice.pad_id

    @property
    def pack_documents(self) -> bool:
        """Whether training samples are packed documents with ``"document_ids"``."""
        return self.settings.pack_documents

    def prepare_data(self) -> None:
        """Build the processed corpus in the cache (once per node; a no-op when cached)."""
        build_long_document_splits(self.source, self.settings, self.cache_dir,
                                   self.tokenizer_choice)

    def setup(self, stage: str | None = None) -> None:
        """Load the splits from the cache (building them if ``prepare_data`` did not run)."""
        if self.splits is not None:
            return
        self.splits = build_long_document_splits(self.source, self.settings, self.cache_dir,
                                                 self.tokenizer_choice)
        self.tokenizer = self.splits.tokenizer
        if not self.settings.pack_documents:  # packing several documents is then the point
            _check_window_fits_a_document(self.splits, self.settings.seq_len)
        self.train_dataset = self.splits.train
        self.val_dataset, self.test_dataset = self.splits.validation, self.splits.test
        if self.passkey_fraction > 0:
            share = self.passkey_fraction
            count = round(len(self.splits.train) * share / (1 - share))
            passkeys = PasskeyDataset(
                self.settings.seq_len, count, seed=self.seed, label_mode=self.passkey_label_mode,
                tokenizer=self._passkey_tokenizer(self.tokenizer),
            )
            self.train_dataset = ConcatDataset([self.splits.train, passkeys])

    def _passkey_tokenizer(self, tokenizer: Tokenizers | None) -> SubwordTokenizer | None:
        """What ``PasskeyDataset`` counts in: None for bytes, else the data's tokenizer."""
        return None if self.tokenizer_choice.kind == BYTES else tokenizer

    def _loader(self, dataset: Dataset | None, batch_size: int, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("LongDocumentDataModule: call setup() before asking for a loader.")
        return make_loader(dataset, batch_size, self.num_workers, shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, self.eval_batch_size, shuffle=False)


def _check_window_fits_a_document(splits: LongDocumentSplits, seq_len: int) -> None:
    """Refuse windows longer than every document: each would pack several documents and no
    window would hold one context of ``seq_len`` tokens."""
    unit = "num_tokens" if "num_tokens" in splits.documents.column_names else "num_bytes"
    sizes = splits.documents[unit]
    longest = max(sizes) if len(sizes) else 0
    if longest + 1 < seq_len:  # a window may hold the document and its closing EOS
        raise UsageError(
            f"seq_len {seq_len} is longer than every document of the corpus (longest: {longest} "
            f"{unit.removeprefix('num_')} at {splits.path}): each window would pack several "
            f"short documents. Lower seq_len to at most {longest + 1}, or give data_files with "
            "longer documents."
        )
