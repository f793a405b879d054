"""A length curriculum: short training windows first, then long ones, at equal tokens per step.

The datamodule serves training windows of the longest length ``T`` (its ``seq_len``);
:class:`LengthCurriculum` cuts each into ``T / L`` consecutive windows of the current stage's
length ``L`` before the step (:func:`split_windows`). A stream cut every ``T`` tokens and
split so is the stream cut every ``L`` tokens: the same windows as a datamodule with
``seq_len: L`` (with ``pack_documents``, the same ``document_ids``), ``batch_size * T / L`` of
them per step, so the tokens per step stay equal and the data order, its position in the
checkpoint and the learning-rate schedule are the run's, whatever the stage. The stage, the
RoPE base and the passkey examples (in the data's tokens) are functions of the optimizer step
alone: nothing is saved, and a resumed run (``--ckpt_path``, a full chunk state, a compact
handoff) continues the curriculum where it was, bit-exactly across a switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from longnet.data.subword import SubwordTokenizer
from longnet.data.synthetic import LabelMode, PasskeyDataset, check_passkey_options
from longnet.data.tokenizer import BYTES
from longnet.nn.positional import RotaryEmbedding
from longnet.training.module import PASSKEY_ROWS
from longnet.training.parallel.strategy import SequenceParallelLayout
from longnet.training.vocabulary import datamodule_seq_len
from longnet.validation import (
    UsageError,
    check_dropout,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)

STAGE_KEYS = ("step", "seq_len", "rope_theta")
PASSKEY_POOL = 1 << 62  # passkey example indices: step * rows + row, never exhausted


@dataclass(frozen=True)
class Stage:
    """From optimizer step ``step`` on, windows of ``seq_len`` tokens and (when not None) the
    RoPE base ``rope_theta``."""

    step: int
    seq_len: int
    rope_theta: float | None = None


def split_windows(batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """Cut a training batch of windows ``(batch, T)`` into ``(batch * T / seq_len, seq_len)``
    consecutive windows, in place (views, no copy); returns ``batch``.

    Every ``(batch, T)`` tensor is reshaped (``input_ids``, ``labels``, ``document_ids``);
    ``document_ids`` are renumbered from 0 in each window, as the datamodule numbers them.

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
    """Train on short windows first, then on longer ones, at the same tokens per step (module
    docstring), optionally with a RoPE base per stage and passkey examples of each stage's
    length mixed in.

    Set the datamodule's ``seq_len`` to the longest stage's length and its ``batch_size`` to
    that stage's batch: a stage of length ``L`` then trains ``batch_size * seq_len / L``
    windows per step. The stage's RoPE base is set on the model (its config, every rotary
    embedding, and the module's ``overrides`` hyper-parameter, so checkpoints and the export
    name it) before each training step; a stage without one keeps the previous stage's base,
    the first such the model's configured one. Validation and test windows are the
    datamodule's (the longest length) and use the base of the stage trained last.

    ``train/seq_len`` is logged at every step.

    Args:
        stages: ``[{step: 0, seq_len: 4096, rope_theta: 1.0e5}, {step: 2000, seq_len: 16384},
            ...]``: the first at step 0, steps increasing, each ``seq_len`` a divisor of the
            datamodule's.
        passkey_fraction: share in ``[0, 1)`` of each step's windows replaced by passkey
            examples of the stage's length (which windows: drawn from ``seed`` and the step
            over the windows of all data-parallel ranks, each example on one rank:
            :meth:`passkey_draws`; their ``document_ids`` are 0), in the data's tokens:
            bytes, or a subword tokenizer's (``PasskeyDataset(tokenizer=...)``; the rows'
            ``label_bytes`` too).
            The datamodule's own ``passkey_fraction`` must be 0 (its examples are as long as
            its ``seq_len`` and would be cut).
        passkey_label_mode: what the examples label (``PasskeyDataset``'s ``label_mode``).
        seed: seed of the examples and of the windows they replace.

    Raises:
        ValueError: (here) malformed stages or passkey settings, naming the entry; every
            passkey setting is checked, whether or not ``passkey_fraction`` turns them on.
        UsageError: (``setup``) a stage length that does not divide the datamodule's, data
            with its own passkey examples, passkeys in a stage too short for them (naming the
            shortest length, in the data's tokens), a subword tokenizer not loaded yet, a
            RoPE base for a model without rotary positions, or a sequence-parallel strategy
            (its batches are shards).
    """

    def __init__(
        self,
        stages: list[dict[str, int | float]],
        passkey_fraction: float = 0.0,
        passkey_label_mode: LabelMode = "recall",
        seed: int = 0,
    ) -> None:
        self.stages = _check_stages(stages)
        # every option, passkeys on or off; the stages' lengths at setup, in the data's tokens
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
        """The RoPE base of optimizer step ``step``: the last stage's up to it that names one,
        else the model's configured one (None before ``setup``)."""
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
        """Take the data's subword tokenizer (None: bytes) and build every stage's examples,
        refusing a stage too short for them."""
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
        """The passkey examples of a stage of ``seq_len`` tokens of ``tokenizer`` (None:
        bytes), indexed as :meth:`passkey_draws` gives."""
        return PasskeyDataset(seq_len, PASSKEY_POOL, seed=self.seed,
                              label_mode=self.passkey_label_mode, tokenizer=tokenizer)

    def passkey_draws(
        self, step: int, rows: int, rank: int = 0, world_size: int = 1
    ) -> list[tuple[int, int]]:
        """``[(row, index), ...]``: which of the ``rows`` windows that rank ``rank`` of
        ``world_size`` data-parallel ranks trains at optimizer step ``step`` passkey examples
        replace, and the index of each one's example in its stage's :meth:`passkey_examples`.
        The step's ``world_size * rows`` windows are drawn together, each rank taking its
        own slice, so no two ranks train the same example. Empty without passkeys."""
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
        """Replace the windows drawn for ``step`` on rank ``rank`` of ``world_size`` by passkey
        examples of ``seq_len`` tokens (with a subword tokenizer, their ``label_bytes`` too)
        and mark them (``batch[PASSKEY_ROWS]``)."""
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
    """Give the module's model the RoPE base ``theta``: its config, every rotary embedding
    (RoPE and xPos) and the module's ``overrides`` hyper-parameter (what checkpoints record and
    ``checkpoint_config`` rebuilds the model from)."""
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

