"""DataLoader construction shared by the DataModules."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from longnet.validation import check_non_negative_int, check_positive_int


def check_loader_args(batch_size: int, num_workers: int) -> None:
    """Raise ``ValueError`` for a non-positive ``batch_size`` or a negative ``num_workers``."""
    check_positive_int("batch_size", batch_size)
    check_non_negative_int("num_workers", num_workers)


def make_loader(dataset: Dataset, batch_size: int, num_workers: int, shuffle: bool) -> DataLoader:
    """A DataLoader over a map-style dataset of samples; batches are
    ``{"input_ids": (batch, seq_len), "labels": (batch, seq_len)}``. ``batch_size`` and
    ``num_workers`` are integers checked by :func:`check_loader_args` (NumPy ones too, given
    to torch as ``int``). Under a distributed strategy Lightning swaps in a
    ``DistributedSampler`` (which keeps ``shuffle``)."""
    return DataLoader(
        dataset,
        batch_size=int(batch_size),
        shuffle=shuffle,
        num_workers=int(num_workers),
        persistent_workers=num_workers > 0,
    )
