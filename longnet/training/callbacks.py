"""Callbacks that keep a run's state and its trained model in the run folder: the last
checkpoint (``last.ckpt``), the validation after the last step, the exported model."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from longnet.data.subword import SubwordTokenizer
from longnet.files import check_output_folder, check_target
from longnet.modeling import LongNetLM
from longnet.training.checkpoint import (
    MODEL_PREFIX,
    SHARDED_META,
    STATE_DICT,
    load_lightning_checkpoint,
    read_checkpoint,
)
from longnet.training.lora import base_folder, save_delta
from longnet.training.run_folder import RUN_ID_KEY, run_dir
from longnet.validation import UsageError, check_positive_int


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether the fit loop validates after the batch whose ``on_train_batch_end`` runs now."""
    fit_loop = trainer.fit_loop
    return fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher)


class ValidateLastStep(L.Callback):
    """Validate after the last optimizer step of ``fit`` too (via ``should_stop``), so the
    best checkpoint, export and ``metrics.json`` are not behind the last step."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step + 1:
            trainer.should_stop = True


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` steps, after each validation and at the end
    of ``fit``, written after the other checkpoint callbacks so it never names a deleted file;
    a resume forgets gone files and deletes the interrupted run's newer checkpoints.

    Args:
        dirpath: folder of ``last.ckpt``; None is ``<run folder>/checkpoints``.
        every_n_train_steps: save interval in optimizer steps.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 100) -> None:
        check_positive_int("every_n_train_steps", every_n_train_steps)
        super().__init__(
            dirpath=dirpath, save_last=True, save_top_k=0,
            every_n_train_steps=every_n_train_steps,
            # a resume from another folder's last.ckpt would write last-v1.ckpt beside it,
            # and the next --ckpt_path last would resume the stale one
            enable_version_counter=False,
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # after every other checkpoint callback: a new list, the one being iterated is kept
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not validation_follows(trainer):  # else saved after the validation
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking \
                and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save_now(self, trainer: L.Trainer) -> Path | None:
        """Write ``last.ckpt`` unless current (collective); its path, None outside training."""
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return None
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return Path(self.last_model_path)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """When ``fit`` resumes: drop other folders' states and clean up (class docstring)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        states = checkpoint.get("callbacks") or {}
        here = {c.state_key: c for c in trainer.checkpoint_callbacks
                if isinstance(c, ModelCheckpoint)}
        known: set[str] = set()
        for key in list(states):
            callback, state = here.get(key), states[key]
            if callback is None or not isinstance(state, Mapping) or "best_k_models" not in state:
                continue
            if state.get("dirpath") != callback.dirpath:
                del states[key]
                continue
            states[key] = state = forget_missing_files(dict(state), callback.mode)
            known.update(state["best_k_models"])
            if state.get("last_model_path"):
                known.add(state["last_model_path"])
        if trainer.is_global_zero and trainer.ckpt_path:
            folders = {Path(c.dirpath) for c in here.values() if c.dirpath}
            remove_newer_checkpoints(folders, known, trainer.ckpt_path, checkpoint)


def forget_missing_files(state: dict[str, Any], mode: str) -> dict[str, Any]:
    """A ``ModelCheckpoint`` state without its deleted checkpoints, best and k-th recomputed."""
    kept = {path: score for path, score in state["best_k_models"].items() if Path(path).exists()}
    gone = sorted(set(state["best_k_models"]) - set(kept))
    if not gone:
        return state
    rank_zero_info(f"The resumed checkpoint names {', '.join(gone)}, deleted after it was "
                   "written (the top-k checkpoints moved on): forgotten.")
    best, worst = (min, max) if mode == "min" else (max, min)
    best_path = best(kept, key=kept.get) if kept else ""
    kth_path = worst(kept, key=kept.get) if kept else ""
    return {
        **state,
        "best_k_models": kept,
        "best_model_path": best_path,
        "best_model_score": kept[best_path] if kept else None,
        "kth_best_model_path": kth_path,
        "kth_value": kept[kth_path] if kept else torch.tensor(
            float("inf") if mode == "min" else float("-inf")),
    }


def remove_newer_checkpoints(folders: set[Path], known: set[str], resumed: str | Path,
                             checkpoint: Mapping[str, Any]) -> None:
    """Delete checkpoints not in ``known`` that the same run wrote after ``resumed``."""
    run_id = checkpoint.get(RUN_ID_KEY)
    if run_id is None:
        return
    resumed = Path(resumed)
    written = (resumed / SHARDED_META if resumed.is_dir() else resumed).stat().st_mtime_ns
    known = {os.path.realpath(path) for path in known} | {os.path.realpath(resumed)}
    for folder in folders:
        for path in sorted(folder.glob("*.ckpt")):
            if os.path.realpath(path) in known or path.stat().st_mtime_ns <= written \
                    or path.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST):
                continue
            try:
                other = read_checkpoint(path, tensors=False)
            except (OSError, ValueError):
                continue  # not a checkpoint this run can read: not one of its own
            if other.get(RUN_ID_KEY) == run_id:
                rank_zero_info(f"Removing {path} (step {other.get('global_step')}): written "
                               f"after {resumed} by the interrupted run, it is redone.")
                path.unlink() if path.is_file() else shutil.rmtree(path)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole ``state_dict`` of ``model`` on the CPU. An FSDP-sharded model is gathered: a
    collective, call it on EVERY rank; only rank 0 gets the tensors."""
    if any(isinstance(param, DTensor) for param in model.parameters()):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}


class ExportPretrained(L.Callback):
    """At the end of ``fit``, write the model (``save_pretrained``; a LoRA run's delta folder)
    with the data's tokenizer files. A bad destination stops ``fit`` in ``setup``; a given
    ``dirpath`` holding a model is replaced only by a resumed fit or with ``overwrite``.

    Args:
        dirpath: destination; None is ``<run folder>/model``.
        weights: ``"best"`` (the first ``ModelCheckpoint``'s best, if any) or ``"last"``.
        overwrite: replace a model or checkpoint that ``dirpath`` holds on a fresh fit too.
    """

    def __init__(self, dirpath: str | None = None, weights: str = "best",
                 overwrite: bool = False) -> None:
        if weights not in ("best", "last"):
            raise ValueError(f"weights must be 'best' or 'last', got {weights!r}.")
        self.dirpath, self.weights, self.overwrite = dirpath, weights, overwrite

    def destination(self, trainer: L.Trainer) -> Path:
        """``dirpath``, else ``<run folder>/model`` (a collective: :func:`run_dir`)."""
        return Path(self.dirpath) if self.dirpath else run_dir(trainer) / "model"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """For ``fit``: check :meth:`destination` on rank 0, raise its error on every rank."""
        if stage != TrainerFn.FITTING:
            return
        target, problem = self.destination(trainer), None
        if trainer.is_global_zero:
            try:
                check_output_folder(target, what="ExportPretrained dirpath")
                base = getattr(pl_module, "lora_base", None)
                check_target(target, overwrite=True, what="ExportPretrained dirpath", sources={
                    "the LoRA base": base_folder(base["source"]) if base else None})
            except UsageError as err:
                problem = str(err)
        problem = trainer.strategy.broadcast(problem)
        if problem:
            raise UsageError(problem)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fresh fit must not replace a model in a given ``dirpath`` unless ``overwrite``."""
        if self.dirpath is None or self.overwrite or trainer.ckpt_path is not None:
            return
        problem = None
        if trainer.is_global_zero:
            try:
                check_target(self.dirpath, what="ExportPretrained dirpath")
            except UsageError as err:
                problem = (f"{err} (a fresh fit; set ExportPretrained's overwrite: true, or "
                           "resume the run that wrote it with --ckpt_path)")
        problem = trainer.strategy.broadcast(problem)
        if problem:
            raise UsageError(problem)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model: LongNetLM = pl_module.model
        target = self.destination(trainer)
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
        lora = getattr(pl_module, "lora", None)
        # on every rank: may gather
        state = None if use_best or lora is not None else full_state_dict(model)
        if trainer.is_global_zero:
            if lora is not None:
                delta = read_checkpoint(best)[STATE_DICT] if use_best else pl_module.state_dict()
                hp = pl_module.hparams
                save_delta(target, {name[len(MODEL_PREFIX):]: tensor
                                    for name, tensor in delta.items()},
                           base=hp["pretrained"], settings=lora, overrides=hp.get("overrides"),
                           base_fingerprint=pl_module.lora_base["fingerprint"], overwrite=True)
            else:
                if use_best:
                    export = load_lightning_checkpoint(best, config=model.config,
                                                       prefix=MODEL_PREFIX)
                else:
                    export = LongNetLM(model.config)
                    export.load_state_dict(state)
                export.save_pretrained(target, overwrite=True)
            tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
            if isinstance(tokenizer, SubwordTokenizer):  # byte models carry their files already
                tokenizer.save(target)
        trainer.strategy.barrier("ExportPretrained")
