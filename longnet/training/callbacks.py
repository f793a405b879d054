"""Callbacks that leave a trained model and its metrics in the run folder."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from longnet.modeling import LongNetLM
from longnet.training.checkpoint import load_lightning_checkpoint
from longnet.training.strategy import SequenceParallelLayout
from longnet.validation import check_positive_int

MODEL_PREFIX = "model."


def run_dir(trainer: L.Trainer) -> Path:
    """The run folder: the logger's ``log_dir`` (else ``trainer.default_root_dir``).

    ``trainer.log_dir`` broadcasts from rank 0: call this on EVERY rank (a rank-zero-only call
    deadlocks a multi-process run).
    """
    return Path(trainer.log_dir or trainer.default_root_dir)


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt``: the whole training state every ``every_n_train_steps`` optimizer steps
    and when ``fit`` ends, for ``fit --ckpt_path last`` after an interruption.

    A ``ModelCheckpoint`` (so ``ckpt_path="last"`` finds it) that keeps no top-k files; pair it
    with a ``ModelCheckpoint(monitor="val/loss")`` for the best weights.

    Args:
        dirpath: folder of ``last.ckpt``; None is ``<run folder>/checkpoints``.
        every_n_train_steps: save interval in optimizer steps.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 100) -> None:
        check_positive_int("every_n_train_steps", every_n_train_steps)
        super().__init__(
            dirpath=dirpath, save_last=True, save_top_k=0,
            every_n_train_steps=every_n_train_steps,
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole ``state_dict`` of ``model`` on the CPU. A model sharded by FSDP
    (``ShardedSequenceParallelStrategy``) is gathered: a collective, call it on EVERY rank;
    only rank 0 gets the tensors (the other ranks an empty dict)."""
    if any(isinstance(param, DTensor) for param in model.parameters()):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}


class ExportPretrained(L.Callback):
    """At the end of ``fit``, write the model with ``save_pretrained`` (config.json,
    model.safetensors, README.md card), loadable with ``LongNetLM.from_pretrained(dirpath)``.

    A ``fit`` that took no optimizer step (``max_steps: 0``, ``limit_train_batches: 0``,
    ``max_epochs: 0``, stopped before the first step) has no trained weights: nothing is
    written, with a warning.

    Under ``ShardedSequenceParallelStrategy`` the final weights are gathered from every
    rank's shards, and the best checkpoint is a folder of shards read on rank 0
    (:func:`~longnet.training.read_checkpoint`).

    Args:
        dirpath: destination; None is ``<run folder>/model``.
        weights: ``"best"``: the best checkpoint of the first ``ModelCheckpoint`` that has one
            (what ``test`` with ``ckpt_path="best"`` evaluates); ``"last"`` or no best
            checkpoint: the weights at the end of training.
    """

    def __init__(self, dirpath: str | None = None, weights: str = "best") -> None:
        if weights not in ("best", "last"):
            raise ValueError(f"weights must be 'best' or 'last', got {weights!r}.")
        self.dirpath, self.weights = dirpath, weights
        self.exported: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model: LongNetLM = pl_module.model
        target = Path(self.dirpath) if self.dirpath else run_dir(trainer) / "model"
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") or ""
        if trainer.global_step == 0:
            if trainer.is_global_zero:
                warnings.warn(
                    f"ExportPretrained: fit took no optimizer step (max_steps="
                    f"{trainer.max_steps}), so there are no trained weights; {target} is not "
                    "written. Train for at least one step to export a model.",
                    stacklevel=2,
                )
            return
        use_best = self.weights == "best" and bool(best)
        state = None if use_best else full_state_dict(model)  # on every rank: may gather
        if trainer.is_global_zero:
            if use_best:
                export = load_lightning_checkpoint(best, config=model.config, prefix=MODEL_PREFIX)
            else:
                export = LongNetLM(model.config)
                export.load_state_dict(state)
            export.save_pretrained(target)
        self.exported = target
        trainer.strategy.barrier("ExportPretrained")


class MetricsSummary(L.Callback):
    """Write the last validation and test metrics to ``<run folder>/metrics.json``.

    ``{"validate": {...}, "test": {...}}``, each with ``step``, the ``run_id`` of the run that
    wrote it (the logger's, when it has one) and every ``val/*`` or ``test/*`` value; updated
    after every validation (outside the sanity check) and test.
    """

    def __init__(self, filename: str = "metrics.json") -> None:
        self.filename = filename

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, "validate", "val/")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test", "test/")

    def _write(self, trainer: L.Trainer, section: str, prefix: str) -> None:
        path = run_dir(trainer) / self.filename  # on every rank: log_dir is a collective
        if not trainer.is_global_zero:
            return
        values: dict[str, Any] = {"step": trainer.global_step}
        run_id = getattr(trainer.logger, "run_id", None)
        if run_id is not None:
            values["run_id"] = run_id
        for key, value in trainer.callback_metrics.items():
            if key.startswith(prefix):
                number = float(value)
                values[key] = number if math.isfinite(number) else str(number)
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[section] = values
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


class PredictionsWriter(BasePredictionWriter):
    """Write ``predict`` outputs (per-sample ``loss_sum``, ``num_tokens``, ``bpb``) as JSON
    lines, one file per data-parallel rank: ``<dirpath>/predictions-<rank>.jsonl``.

    Args:
        dirpath: destination folder; None is the run folder.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self._folder: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # resolved here, on every rank (log_dir is a collective; ranks may get different
        # numbers of predict batches)
        self._folder = Path(self.dirpath) if self.dirpath else run_dir(trainer)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                           batch_idx, dataloader_idx) -> None:
        folder = self._folder or Path(self.dirpath or trainer.default_root_dir)
        strategy, rank = trainer.strategy, trainer.global_rank
        if isinstance(strategy, SequenceParallelLayout):
            if strategy.sequence_parallel_rank != 0:
                return  # the other ranks of a sequence-parallel group hold the same values
            rank = strategy.data_parallel_rank
        folder.mkdir(parents=True, exist_ok=True)
        columns = {key: value.tolist() for key, value in prediction.items()}
        indices = list(batch_indices) if batch_indices is not None else [None] * len(
            next(iter(columns.values())))
        with open(folder / f"predictions-{rank}.jsonl", "a") as handle:
            for row, index in enumerate(indices):
                record = {"index": index, **{key: column[row] for key, column in columns.items()}}
                handle.write(json.dumps(record) + "\n")
