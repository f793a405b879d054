"""DataLoader construction shared by the DataModules."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset


def check_loader_args(batch_size: int, num_workers: int) -> None:
    """Raise ``ValueError`` for a non-positive ``batch_size`` or a negative ``num_workers``."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}.")


def make_loader(dataset: Dataset, batch_size: int, num_workers: int, shuffle: bool) -> DataLoader:
    """A DataLoader over a map-style dataset of samples; batches are
    ``{"input_ids": (batch, seq_len), "labels": (batch, seq_len)}``. Under a distributed
    strategy Lightning swaps in a ``DistributedSampler`` (which keeps ``shuffle``)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
