"""The Lightning DataModules: windows of long documents and the generated tasks."""

from __future__ import annotations

import lightning as L
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from longnet.data.cache import cache_folder
from longnet.data.corpus import CorpusSettings, LongDocumentSplits, build_long_document_splits
from longnet.data.encoding import SPLITS
from longnet.data.reading import InvalidFiles
from longnet.data.repositories import check_package_options, repository_source
from longnet.data.sources import select_source
from longnet.data.subword import SubwordTokenizer
from longnet.data.synthetic import LabelMode, MQARDataset, PasskeyDataset, check_passkey_options
from longnet.data.tokenizer import BYTES, VOCAB_SIZE, Tokenizers, parse_tokenizer
from longnet.validation import UsageError, check_non_negative_int, check_positive_int


class _Loaders(L.LightningDataModule):
    """Loaders of the split datasets a subclass sets, training ones shuffled."""

    def __init__(self, batch_size: int, num_workers: int,
                 eval_batch_size: int | None = None) -> None:
        super().__init__()
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        for name, size in (("batch_size", batch_size), ("eval_batch_size", self.eval_batch_size)):
            check_positive_int(name, size)
        check_non_negative_int("num_workers", num_workers)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    def _loader(self, dataset: Dataset | None, batch_size: int, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a loader.")
        return DataLoader(dataset, batch_size=int(batch_size), shuffle=shuffle,
                          num_workers=int(self.num_workers),
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, self.eval_batch_size, shuffle=False)


class LongDocumentDataModule(_Loaders):
    """Windows of long documents in tokens of a chosen tokenizer, bytes by default
    (``longnet.data.encoding``; recipe: ``data/README.md``). Samples may also hold
    ``"document_ids"`` (``pack_documents``) and ``"label_bytes"`` (subword tokenizers).

    Args:
        seq_len: tokens per sample.
        batch_size: samples per training batch.
        data_files: glob(s) of local text or table files (``sources.files_source``).
        corpus: ``"stdlib"`` (the default) and/or installed distributions (``"sympy==1.14.0"``).
        text_column: column holding the text in table rows.
        invalid_files: text files that are binary or not UTF-8: ``"error"`` or ``"skip"``.
        val_fraction, test_fraction: expected shares of documents held out (hash split).
        max_documents, max_bytes: keep only the first documents (source order).
        min_document_bytes: drop documents shorter than this (all splits).
        passkey_fraction: share in ``[0, 1)`` of training samples that are passkey examples.
        passkey_label_mode: ``"all"``, ``"answer"`` or ``"recall"`` (``PasskeyDataset``).
        seed: seed of the mixed-in passkey examples.
        cache_dir: where processed corpora are cached; None: ``cache.default_cache_dir``.
        num_workers: DataLoader worker processes.
        eval_batch_size: samples per validation/test batch; None uses ``batch_size``.
        pack_documents: training windows of whole documents with ``document_ids``, so the
            model attends within each document only. Not with ``passkey_fraction``.
        packages: one document per package instead (``longnet.data.repositories``).
        held_out: with ``packages``, ``{"validation": [...], "test": [...]}`` instead of the hash.
        tokenizer: ``"bytes"``, ``"bpe:<vocab size>"``, a ``tokenizer.json``, a tokenizer or
            model folder, or a zoo name; the model takes its ``vocab_size`` from it.

    Raises:
        FileNotFoundError: a ``data_files`` pattern matches nothing.
        ValueError: an argument out of range or a malformed ``corpus`` entry.
        UsageError: a ``corpus`` distribution not installed as pinned, a bad ``tokenizer``, or
            (in ``prepare_data``/``setup``) data that cannot be used.
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
        super().__init__(batch_size, num_workers, eval_batch_size)
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

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (a BPE's: the size asked)."""
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


def _check_window_fits_a_document(splits: LongDocumentSplits, seq_len: int) -> None:
    """Refuse a ``seq_len`` longer than every document (each window would pack several)."""
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


class _SyntheticDataModule(_Loaders):
    """One generated dataset per split, made by the subclass's ``make_dataset``."""

    def __init__(
        self, batch_size: int, num_workers: int, train_size: int, val_size: int, test_size: int
    ) -> None:
        super().__init__(batch_size, num_workers)
        sizes = dict(zip(SPLITS, (train_size, val_size, test_size)))
        self.datasets = {split: self.make_dataset(split, size) for split, size in sizes.items()}
        self.train_dataset, self.val_dataset, self.test_dataset = self.datasets.values()

    def make_dataset(self, split: str, size: int) -> Dataset:
        """The dataset of ``split`` with ``size`` samples."""
        raise NotImplementedError


class PasskeyDataModule(_SyntheticDataModule):
    """Passkey retrieval samples (:class:`~longnet.data.PasskeyDataset`).

    Args:
        seq_len: tokens per sample.
        batch_size: samples per batch.
        train_size, val_size, test_size: samples per split.
        depth: needle depth in ``[0, 1]``; None draws it per sample.
        num_digits: digits of the key.
        label_mode: ``"answer"``, ``"recall"`` or ``"all"``.
        seed: generation seed.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 1024,
        batch_size: int = 8,
        train_size: int = 20_000,
        val_size: int = 256,
        test_size: int = 256,
        depth: float | None = None,
        num_digits: int = 5,
        label_mode: LabelMode = "answer",
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.seq_len, self.depth, self.num_digits = seq_len, depth, num_digits
        self.label_mode, self.seed = label_mode, seed
        super().__init__(batch_size, num_workers, train_size, val_size, test_size)
        self.save_hyperparameters()

    @property
    def vocab_size(self) -> int:
        """Token ids are bytes: 256."""
        return VOCAB_SIZE

    def make_dataset(self, split: str, size: int) -> PasskeyDataset:
        return PasskeyDataset(
            self.seq_len, size, seed=self.seed, split=split, depth=self.depth,
            num_digits=self.num_digits, label_mode=self.label_mode,
        )


class MQARDataModule(_SyntheticDataModule):
    """Multi-query associative recall samples (:class:`~longnet.data.MQARDataset`).

    Args:
        seq_len: tokens per sample.
        batch_size: samples per batch.
        train_size, val_size, test_size: samples per split.
        num_kv_pairs: key-value pairs per sample.
        num_queries: keys asked per sample; None asks every key.
        vocab_size: token ids are in ``[0, vocab_size)``.
        seed: generation seed.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 64,
        train_size: int = 100_000,
        val_size: int = 1_000,
        test_size: int = 1_000,
        num_kv_pairs: int = 4,
        num_queries: int | None = None,
        vocab_size: int = VOCAB_SIZE,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.seq_len, self.num_kv_pairs, self.num_queries = seq_len, num_kv_pairs, num_queries
        self.vocab_size, self.seed = vocab_size, seed
        super().__init__(batch_size, num_workers, train_size, val_size, test_size)
        self.save_hyperparameters()

    def make_dataset(self, split: str, size: int) -> MQARDataset:
        return MQARDataset(
            self.seq_len, size, num_kv_pairs=self.num_kv_pairs, num_queries=self.num_queries,
            vocab_size=self.vocab_size, seed=self.seed, split=split,
        )
