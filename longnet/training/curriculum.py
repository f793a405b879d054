"""What each training step reads: a resumable, exact data order (:class:`ResumableDataOrder`:
a ``(seed, epoch)`` permutation split ``indices[rank::replicas]``, resumed mid-epoch exactly,
each evaluation sample once) and a length curriculum (:class:`LengthCurriculum`: windows of the
longest length cut into the stage's, a pure function of the optimizer step).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler, Sampler

from longnet.data.subword import SubwordTokenizer
from longnet.data.synthetic import LabelMode, PasskeyDataset, check_passkey_options
from longnet.data.tokenizer import BYTES
from longnet.nn.positional import RotaryEmbedding
from longnet.training.metrics import PASSKEY_ROWS
from longnet.training.parallel.strategy import SequenceParallelLayout
from longnet.training.vocabulary import datamodule_seq_len
from longnet.validation import (
    UsageError,
    check_dropout,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)

LOADER_HOOKS = {"train_dataloader": "train", "val_dataloader": "eval", "test_dataloader": "eval"}
STAGE_KEYS = ("step", "seq_len", "rope_theta")
PASSKEY_POOL = 1 << 62  # passkey example indices: step * rows + row, never exhausted


class EpochIndexSampler(Sampler[int]):
    """This replica's sample indices of one epoch (module docstring); ``skip`` samples are
    dropped from the front of the next iteration only."""

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
    """Batches in :class:`EpochIndexSampler` order, stateful so checkpoints keep the position.

    Args:
        base: the datamodule's loader; all but its sampler is kept.
        seed: seed of the shuffled order.
        num_replicas, rank: data-parallel layout.
        pad: wrap-pad so every replica gets as many samples (training).
        consumed: the trainer's finished batches of the epoch; None records 0.
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
    """Serve the datamodule's train/val/test ``DataLoader``\\ s over map-style datasets as
    :class:`EpochLoader`\\ s (anything else is left to Lightning).

    Args:
        seed: seed of the shuffled training order; None: ``PL_GLOBAL_SEED`` or 0. A resumed
            run reuses the checkpoint's.
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


@dataclass(frozen=True)
class Stage:
    """From optimizer ``step`` on, windows of ``seq_len`` tokens and RoPE base ``rope_theta``."""

    step: int
    seq_len: int
    rope_theta: float | None = None


def split_windows(batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """Cut every ``(batch, T)`` tensor of a training batch into ``(batch * T / seq_len,
    seq_len)`` consecutive windows, in place (views); ``document_ids`` renumbered from 0 per
    window. Returns ``batch``.

    Raises:
        ValueError: ``T`` is not a multiple of ``seq_len``.
    """
    rows, length = batch["input_ids"].shape
    if length % seq_len:
        raise ValueError(f"windows of {length} tokens cannot be cut into windows of {seq_len}.")
    if length == seq_len:
        return batch
    for key, value in batch.items():
        if isinstance(value, Tensor) and tuple(value.shape) == (rows, length):
            batch[key] = value.reshape(-1, seq_len)
    if "document_ids" in batch:
        ids = batch["document_ids"]
        batch["document_ids"] = ids - ids[:, :1]
    return batch


class LengthCurriculum(L.Callback):
    """Train on short windows first, then longer ones, at the same tokens per step, optionally
    with a RoPE base per stage (kept until the next names one) and passkey examples mixed in.
    The datamodule's ``seq_len`` and ``batch_size`` are the longest stage's. Logs
    ``train/seq_len``.

    Args:
        stages: ``[{step: 0, seq_len: 4096, rope_theta: 1.0e5}, {step: 2000, seq_len: 16384}]``:
            the first at step 0, steps increasing, each ``seq_len`` dividing the datamodule's.
        passkey_fraction: share in ``[0, 1)`` of each step's windows replaced by passkey
            examples of the stage's length in the data's tokens (:meth:`passkey_draws`). The
            datamodule's own ``passkey_fraction`` must be 0.
        passkey_label_mode: what the examples label (``PasskeyDataset``'s ``label_mode``).
        seed: seed of the examples and of the windows they replace.

    Raises:
        ValueError: malformed stages or passkey settings (all checked), naming the entry.
        UsageError: (``setup``) a stage length not dividing the data's, data with its own
            passkeys, a stage too short for passkeys, a subword tokenizer not loaded yet, a
            RoPE base without rotary positions, or a sequence-parallel strategy.
    """

    def __init__(
        self,
        stages: list[dict[str, int | float]],
        passkey_fraction: float = 0.0,
        passkey_label_mode: LabelMode = "recall",
        seed: int = 0,
    ) -> None:
        self.stages = _check_stages(stages)
        # every option is checked, passkeys on or off
        self.passkey_fraction = check_dropout("passkey_fraction", passkey_fraction)
        self.seed = check_non_negative_int("seed", seed)
        check_passkey_options(passkey_label_mode, seed=seed)
        self.passkey_label_mode = passkey_label_mode
        self._passkeys: dict[int, PasskeyDataset] = {}
        self._tokenizer: SubwordTokenizer | None = None
        self._configured_theta: float | None = None
        self._announced: Stage | None = None

    def stage_at(self, step: int) -> Stage:
        """The stage of optimizer step ``step`` (an integer >= 0; a ``ValueError`` else)."""
        check_non_negative_int("LengthCurriculum.stage_at: step", step)
        return [stage for stage in self.stages if stage.step <= step][-1]

    def rope_theta_at(self, step: int) -> float | None:
        """The RoPE base at ``step``: the last named, else the model's (None before setup)."""
        check_non_negative_int("LengthCurriculum.rope_theta_at: step", step)
        named = [s.rope_theta for s in self.stages if s.step <= step and s.rope_theta]
        return named[-1] if named else self._configured_theta

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule = trainer.datamodule
        length = datamodule_seq_len(datamodule)
        if length is None:
            raise UsageError("LengthCurriculum needs a datamodule with a seq_len (the longest "
                             "stage's window), e.g. longnet.data.LongDocumentDataModule.")
        for entry in self.stages:
            if length % entry.seq_len:
                raise UsageError(
                    f"LengthCurriculum: the stage at step {entry.step} has seq_len "
                    f"{entry.seq_len}, which does not divide the data's seq_len {length}; make "
                    "the data's seq_len the longest stage's and every stage's a divisor of it.")
        if getattr(datamodule, "passkey_fraction", 0):
            raise UsageError(
                "LengthCurriculum: the data mixes in passkey examples of its seq_len "
                f"({length}), which the shorter stages would cut; set the data's "
                "passkey_fraction to 0 and LengthCurriculum's passkey_fraction instead.")
        if self.passkey_fraction:
            self._passkey_setup(datamodule)
        if isinstance(trainer.strategy, SequenceParallelLayout):
            raise UsageError("LengthCurriculum works on whole windows: not with a "
                             "sequence-parallel strategy, whose batches are shards.")
        config = pl_module.model.config
        if any(s.rope_theta for s in self.stages) and config.position_encoding not in (
                "rope", "xpos"):
            raise UsageError(
                f"LengthCurriculum sets a RoPE base, but the model's position_encoding is "
                f"{config.position_encoding!r} (no rotary positions); drop rope_theta from "
                "the stages.")
        self._configured_theta = config.rope_theta

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        stage = self.stage_at(step)
        theta = self.rope_theta_at(step)
        if theta is not None:
            set_rope_theta(pl_module, theta)
        split_windows(batch, stage.seq_len)
        if self.passkey_fraction:
            self._mix_passkeys(batch, step, stage.seq_len, trainer.global_rank,
                               trainer.world_size)
        if stage != self._announced:
            rows = batch["input_ids"].shape[0]
            rank_zero_info(f"Length curriculum: from step {step:,}, windows of "
                           f"{stage.seq_len:,} tokens, {rows} per step (RoPE base {theta}).")
            self._announced = stage
        pl_module.log("train/seq_len", float(stage.seq_len))

    def _passkey_setup(self, datamodule: Any) -> None:
        """Take the data's tokenizer and build every stage's examples (too short: refused)."""
        choice = getattr(datamodule, "tokenizer_choice", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if getattr(choice, "kind", BYTES) != BYTES and not isinstance(tokenizer,
                                                                      SubwordTokenizer):
            raise UsageError(
                f"LengthCurriculum: the data's tokenizer ({choice.kind}) is not loaded, so "
                "its passkey examples cannot be counted in its tokens; set the datamodule up "
                "before the trainer's setup, or set passkey_fraction to 0.")
        self._tokenizer = tokenizer if isinstance(tokenizer, SubwordTokenizer) else None
        self._passkeys = {}
        for entry in self.stages:
            try:
                self._passkey_examples(entry.seq_len)
            except ValueError as err:
                raise UsageError(f"LengthCurriculum: the stage at step {entry.step} has "
                                 f"passkey_fraction {self.passkey_fraction}: {err}") from None

    def passkey_examples(
        self, seq_len: int, tokenizer: SubwordTokenizer | None = None
    ) -> PasskeyDataset:
        """The passkey examples of ``seq_len`` tokens of ``tokenizer`` (None: bytes)."""
        return PasskeyDataset(seq_len, PASSKEY_POOL, seed=self.seed,
                              label_mode=self.passkey_label_mode, tokenizer=tokenizer)

    def passkey_draws(
        self, step: int, rows: int, rank: int = 0, world_size: int = 1
    ) -> list[tuple[int, int]]:
        """``[(row, index), ...]``: rank ``rank``'s rows replaced at ``step`` and each example's
        index, drawn over all ranks' windows so no two ranks train the same example."""
        check_non_negative_int("LengthCurriculum.passkey_draws: step", step)
        check_positive_int("LengthCurriculum.passkey_draws: rows", rows)
        check_positive_int("LengthCurriculum.passkey_draws: world_size", world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"LengthCurriculum.passkey_draws: rank {rank!r} is not in "
                             f"[0, {world_size}).")
        first, windows = rank * rows, world_size * rows
        draws = np.random.default_rng([self.seed, step]).random(windows)[first:first + rows]
        return [(int(row), step * windows + first + int(row))
                for row in np.flatnonzero(draws < self.passkey_fraction)]

    def _passkey_examples(self, seq_len: int) -> PasskeyDataset:
        """The passkey examples of ``seq_len`` tokens (in the data's tokens after ``setup``)."""
        if seq_len not in self._passkeys:
            self._passkeys[seq_len] = self.passkey_examples(seq_len, self._tokenizer)
        return self._passkeys[seq_len]

    def _mix_passkeys(self, batch: dict[str, Any], step: int, seq_len: int,
                      rank: int, world_size: int) -> None:
        """Replace the windows drawn for ``step`` by passkey examples; mark them (PASSKEY_ROWS)."""
        examples = self._passkey_examples(seq_len)
        rows = batch["input_ids"].shape[0]
        marked = torch.zeros(rows, dtype=torch.bool, device=batch["input_ids"].device)
        for row, index in self.passkey_draws(step, rows, rank, world_size):
            marked[row] = True
            sample = examples[index]
            for key in ("input_ids", "labels", "label_bytes"):
                if key in batch and key in sample:
                    batch[key][row] = sample[key]
            if "document_ids" in batch:
                batch["document_ids"][row] = 0
        batch[PASSKEY_ROWS] = marked


def set_rope_theta(pl_module: L.LightningModule, theta: float) -> None:
    """Set RoPE base ``theta`` in the config, rotary embeddings and ``overrides`` hparam."""
    model = pl_module.model
    if model.config.rope_theta == theta:
        return
    model.config.rope_theta = theta
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.theta = float(theta)
    pl_module.hparams["overrides"] = {**(pl_module.hparams.get("overrides") or {}),
                                      "rope_theta": theta}


def _check_stages(stages: Any) -> list[Stage]:
    """``stages`` as :class:`Stage` s, or ``ValueError`` naming the entry at fault."""
    if not isinstance(stages, list | tuple) or not stages:
        raise ValueError(f"stages must be a non-empty list of {{step, seq_len[, rope_theta]}}, "
                         f"got {stages!r}.")
    checked = []
    for k, entry in enumerate(stages):
        where = f"stages[{k}]"
        if not isinstance(entry, dict) or not {"step", "seq_len"} <= set(entry) \
                or set(entry) - set(STAGE_KEYS):
            raise ValueError(f"{where} must be a mapping with step, seq_len and optionally "
                             f"rope_theta, got {entry!r}.")
        theta = entry.get("rope_theta")
        checked.append(Stage(
            check_non_negative_int(f"{where}.step", entry["step"]),
            check_positive_int(f"{where}.seq_len", entry["seq_len"]),
            None if theta is None else check_positive_float(f"{where}.rope_theta", theta)))
    if checked[0].step != 0:
        raise ValueError(f"stages[0] must start at step 0, got step {checked[0].step}.")
    for k, (before, after) in enumerate(zip(checked, checked[1:]), 1):
        if after.step <= before.step:
            raise ValueError(f"stages[{k}].step {after.step} must be larger than the step "
                             f"before it ({before.step}).")
    return checked

