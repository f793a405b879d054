"""DataModules of the generated long-range tasks: passkey retrieval and MQAR.

Each split is a map-style dataset of a fixed size whose sample ``i`` is generated from
``(seed, split, i)``, so nothing is stored and every run (and every worker/rank) sees the same
samples. Training batches are shuffled; validation/test are in index order.
"""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset

from longnet.data.loaders import check_loader_args, make_loader
from longnet.data.mqar import MQARDataset
from longnet.data.passkey import LabelMode, PasskeyDataset
from longnet.data.splits import SPLITS
from longnet.data.tokenizer import VOCAB_SIZE


class _SyntheticDataModule(L.LightningDataModule):
    """Shared loaders; subclasses build one dataset per split in ``make_dataset``."""

    def __init__(
        self, batch_size: int, num_workers: int, train_size: int, val_size: int, test_size: int
    ) -> None:
        super().__init__()
        check_loader_args(batch_size, num_workers)
        self.batch_size, self.num_workers = batch_size, num_workers
        sizes = dict(zip(SPLITS, (train_size, val_size, test_size)))
        self.datasets = {split: self.make_dataset(split, size) for split, size in sizes.items()}

    def make_dataset(self, split: str, size: int) -> Dataset:
        """The dataset of ``split`` with ``size`` samples."""
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.datasets["train"], self.batch_size, self.num_workers, True)

    def val_dataloader(self) -> DataLoader:
        return make_loader(self.datasets["validation"], self.batch_size, self.num_workers, False)

    def test_dataloader(self) -> DataLoader:
        return make_loader(self.datasets["test"], self.batch_size, self.num_workers, False)


class PasskeyDataModule(_SyntheticDataModule):
    """Passkey retrieval samples of ``seq_len`` tokens (see ``PasskeyDataset``).

    Args:
        seq_len: tokens per sample.
        batch_size: samples per batch.
        train_size, val_size, test_size: samples per split.
        depth: needle depth in ``[0, 1]``; None draws it per sample.
        num_digits: digits of the key.
        label_mode: ``"answer"`` (loss on the key only), ``"recall"`` (the key and the needle's
            second copy of it) or ``"all"`` (every position).
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
    """Multi-query associative recall samples (see ``MQARDataset``).

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
