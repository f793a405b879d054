"""Data order that is a pure function of ``(seed, epoch)``, sharded over data-parallel
replicas, resumable in the middle of an epoch, and exact for evaluation.

Lightning's own handling has three gaps for this project: a plain ``DataLoader`` restarts its
epoch from the first batch after a resume (batches are repeated); a ``RandomSampler`` draws its
order from the global RNG (different after a restart); and the ``DistributedSampler`` pads
evaluation splits with repeated samples (metrics are then not exact). The
:class:`ResumableDataOrder` callback replaces the ``DataLoader``\\ s of the attached
datamodule with :class:`EpochLoader`\\ s that close all three:

- training: a permutation of ``range(len(dataset))`` seeded by ``(seed, epoch)`` (identity
  without shuffling), padded by wrapping to a multiple of the number of data-parallel replicas
  and split ``indices[rank::replicas]`` (the ``DistributedSampler`` layout, so batch ``k`` of
  all replicas together is batch ``k`` of one device with ``replicas`` times the batch size);
  its ``state_dict`` records the epoch and how many batches the trainer has consumed, and a
  resumed run skips exactly those;
- evaluation: the same split without padding (replicas may get one sample less), so summed
  metrics count every sample exactly once.

Replica count and rank come from the strategy's ``distributed_sampler_kwargs`` (data-parallel
size and rank under :class:`~longnet.training.SequenceParallelStrategy`, so every
rank of a sequence-parallel group reads the same samples).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

LOADER_HOOKS = {"train_dataloader": "train", "val_dataloader": "eval", "test_dataloader": "eval"}


class EpochIndexSampler(Sampler[int]):
    """This replica's sample indices of one epoch; see the module docstring.

    ``set_epoch`` chooses the epoch of the next iteration; ``skip`` samples are dropped from
    the front of the next iteration only.
    """

    def __init__(
        self,
        size: int,
        *,
        shuffle: bool,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        pad: bool = True,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid replica layout: rank {rank} of {num_replicas}.")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.num_replicas, self.rank, self.pad = num_replicas, rank, pad
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self, epoch: int) -> list[int]:
        """All of this replica's indices of ``epoch`` (before any skip)."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        if self.pad and self.size:
            total = -(-self.size // self.num_replicas) * self.num_replicas
            order = (order * (total // self.size + 1))[:total]
        return order[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        if self.pad:
            return -(-self.size // self.num_replicas)
        return len(range(self.rank, self.size, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        order, skip = self.indices(self.epoch), self.skip
        self.skip = 0
        return iter(order[skip:])


class EpochLoader:
    """An iterable of batches over a ``DataLoader``'s dataset in :class:`EpochIndexSampler`
    order; stateful (``state_dict``/``load_state_dict``) so Lightning saves it in checkpoints.

    Args:
        base: the datamodule's loader; its dataset, batch size, collate function, workers
            and ``drop_last`` are kept, its sampler is replaced (shuffled if it was a
            ``RandomSampler``).
        seed: seed of the shuffled order.
        num_replicas, rank: data-parallel layout.
        pad: wrap-pad so every replica gets the same number of samples (training).
        consumed: returns how many batches of the current epoch the trainer has finished
            (recorded by ``state_dict``); None records 0.
    """

    def __init__(
        self,
        base: DataLoader,
        *,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        pad: bool = True,
        consumed: Callable[[], int] | None = None,
    ) -> None:
        self.sampler = EpochIndexSampler(
            len(base.dataset),
            shuffle=isinstance(base.sampler, RandomSampler),
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            pad=pad,
        )
        extra: dict[str, Any] = {}
        if base.num_workers > 0:
            extra = {"prefetch_factor": base.prefetch_factor,
                     "persistent_workers": base.persistent_workers}
        self.loader = DataLoader(
            base.dataset,
            batch_size=base.batch_size,
            sampler=self.sampler,
            num_workers=base.num_workers,
            collate_fn=base.collate_fn,
            pin_memory=base.pin_memory,
            drop_last=base.drop_last,
            timeout=base.timeout,
            worker_init_fn=base.worker_init_fn,
            **extra,
        )
        self.dataset = base.dataset
        self.batch_size = base.batch_size
        self._consumed = consumed
        self._iter_epoch = 0

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._iter_epoch = self.sampler.epoch
        return iter(self.loader)

    def state_dict(self) -> dict[str, int]:
        consumed = int(self._consumed()) if self._consumed is not None else 0
        return {"seed": self.sampler.seed, "epoch": self._iter_epoch, "consumed": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after the ``consumed`` batches of ``epoch`` (or at the next epoch)."""
        self.sampler.seed = int(state["seed"])
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed >= len(self):
            epoch, consumed = epoch + 1, 0
        self.sampler.set_epoch(epoch)
        self.sampler.skip = consumed * self.loader.batch_size


def _default_seed() -> int:
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ResumableDataOrder(L.Callback):
    """Serve the datamodule's train/val/test loaders as :class:`EpochLoader`\\ s.

    Attached automatically by :class:`~longnet.training.CausalLMModule` (``resumable_data``).
    Works with datamodules whose loaders are ``DataLoader``\\ s over map-style datasets;
    anything else (an iterable dataset, loaders passed straight to ``trainer.fit``) is left to
    Lightning unchanged.

    Args:
        seed: seed of the shuffled training order; None uses the run's ``seed_everything``
            seed (``PL_GLOBAL_SEED``) or 0. A resumed run reuses the checkpoint's seed.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if datamodule is None:
            return
        # keep the datamodule's own hooks once; rebind the wrappers to this trainer every time
        originals = getattr(datamodule, "_longnet_loader_hooks", None)
        if originals is None:
            originals = {hook: getattr(datamodule, hook) for hook in LOADER_HOOKS}
            datamodule._longnet_loader_hooks = originals
        for hook, mode in LOADER_HOOKS.items():
            setattr(datamodule, hook, self._wrap(trainer, originals[hook], mode))

    def _wrap(self, trainer: L.Trainer, original: Callable[[], Any], mode: str):
        def loader() -> Any:
            base = original()
            if not isinstance(base, DataLoader) or not hasattr(base.dataset, "__len__"):
                return base
            if base.batch_size is None:
                return base  # a custom batch sampler: leave it to Lightning
            kwargs = trainer.distributed_sampler_kwargs or {}
            consumed = None
            if mode == "train":
                consumed = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed
            return EpochLoader(
                base,
                seed=self.seed if self.seed is not None else _default_seed(),
                num_replicas=int(kwargs.get("num_replicas", 1)),
                rank=int(kwargs.get("rank", 0)),
                pad=mode == "train",
                consumed=consumed,
            )

        return loader
