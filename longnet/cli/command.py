"""The ``longnet`` command's :class:`LongNetCLI` and :class:`RunConfigSaver`.

:class:`LongNetCLI` is Lightning's CLI over :class:`longnet.training.CausalLMModule` (or a
subclass) and any ``LightningDataModule``; what it adds is listed in docs/training.md, "The
command". :class:`RunConfigSaver` writes the resolved config into the run folder.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import BasePredictionWriter, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.model_helpers import is_overridden

from longnet.cli.errors import (
    UNION_ERROR,
    ConfigError,
    bad_config_file,
    parse_error_message,
    undecodable_config,
)
from longnet.cli.run_checks import (
    check_batches_to_run,
    check_checkpoint_shape,
    check_default_root_dir,
    check_keyword,
    check_outputs,
    check_overfit_batches,
    check_steps_left,
    check_trained_weights,
    checkpoints_hint,
    describe_run,
    gzip_comparison,
    last_good_checkpoint,
    max_time_cut,
    refuse_earlier_run,
    run_last_checkpoint,
)
from longnet.data.subword import RUN_TOKENIZER_FOLDER, SubwordTokenizer
from longnet.files import write_atomic
from longnet.training import CausalLMModule
from longnet.training.callbacks import ValidateLastStep
from longnet.training.checkpoint import is_sharded_checkpoint, read_checkpoint
from longnet.training.module import TrainingDiverged
from longnet.training.reports import PredictionsWriter, progress_bar
from longnet.training.run_folder import (
    RunId,
    RunLock,
    checkpoint_dirs,
    checkpoint_run_id,
    new_run_id,
    run_dir,
    run_folder,
)
from longnet.training.trainer import AutoPrecisionTrainer, StopOnSignal
from longnet.validation import VERBOSE_FLAG, UsageError, check_positive_int, is_real


def check_trainer_values(config: dict[str, Any]) -> None:
    """Refuse trainer values Lightning accepts silently but cannot use:
    ``accumulate_grad_batches < 1``, ``val_check_interval <= 0``, ``gradient_clip_val < 0``."""
    check_positive_int("trainer.accumulate_grad_batches",
                       config.get("accumulate_grad_batches", 1))
    interval = config.get("val_check_interval")
    if is_real(interval) and interval <= 0:
        raise UsageError(
            f"trainer.val_check_interval must be positive (a number of steps, or a fraction of "
            f"an epoch), got {interval}; to validate less often raise it, to never validate "
            "set --trainer.limit_val_batches 0."
        )
    clip = config.get("gradient_clip_val")
    if is_real(clip) and clip < 0:
        raise UsageError(
            f"trainer.gradient_clip_val must be >= 0 (the largest gradient norm; 0 or null: no "
            f"clipping), got {clip}."
        )


class RunConfigSaver(SaveConfigCallback):
    """Save the resolved config atomically as ``config.yaml`` (fit) or ``config-<stage>.yaml``,
    and for ``fit`` the data's subword tokenizer as ``tokenizer/``."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        stage = getattr(stage, "value", stage)  # a TrainerFn or its string value
        name = "config.yaml" if stage == "fit" else f"config-{stage}.yaml"
        folder = run_dir(trainer)  # on every rank: log_dir is a collective
        if trainer.is_global_zero:
            write_atomic(folder / name, self.parser.dump(self.config, skip_none=False))
            tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
            if stage == "fit" and isinstance(tokenizer, SubwordTokenizer):
                tokenizer.save(folder / RUN_TOKENIZER_FOLDER)
        self.already_saved = True


class LongNetCLI(LightningCLI):
    """The ``longnet`` command (module docstring).

    Args:
        args: the command line after ``longnet`` (``["fit", "--config", "X.yaml"]``); None
            reads ``sys.argv``.
        run: run the subcommand (False: only parse and instantiate).
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            CausalLMModule,
            L.LightningDataModule,
            trainer_class=AutoPrecisionTrainer,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=RunConfigSaver,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"description": "LongNet dilated-attention LMs: train, evaluate. "
                           f"{VERBOSE_FLAG} (anywhere): show the traceback of an error.",
                           "exit_on_error": False},  # main() reports the error in a few lines
            args=list(args) if args is not None else None,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=False,
            help="After fit, test the best checkpoint (or the final weights) in the same "
            "process. Ignored by the other subcommands.",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Lightning's, with a clear error for a config file that is not text, not YAML or not
        a mapping; then a ``--ckpt_path`` file is checked readable."""
        given = sys.argv[1:] if args is None else list(args)
        self.root_dir_given = any(arg.partition("=")[0] == "--trainer.default_root_dir"
                                  for arg in given)
        try:
            super().parse_arguments(parser, args)
        except UnicodeDecodeError as err:
            raise UsageError(undecodable_config(given, err)) from err
        except ArgumentError as err:
            about_file = any(words in str(err) for words in ("Unexpected config",
                                                             "Problems parsing config"))
            message = bad_config_file(given) if about_file else None
            if message is None:
                raise
            raise UsageError(message) from err
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            read_checkpoint(ckpt_path)

    def _parse_ckpt_path(self) -> None:
        """Keep the configured model, where Lightning would replace its arguments by a
        ``--ckpt_path`` file's hyper-parameters (other shapes are refused by ``_run_folder``)."""

    def instantiate_classes(self) -> None:
        """Lightning's (errors as :class:`ConfigError`), then ``model.fit_tokenizer``."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
            message = str(err)
            if message.startswith(UNION_ERROR):  # a class's own error among the alternatives
                raise ConfigError(parse_error_message(message)) from err
            raise ConfigError(f"{type(err).__name__}: {message}") from err
        if isinstance(self.model, CausalLMModule):
            self.model.fit_tokenizer(self.datamodule)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """Lightning's, with :class:`RunId` (first), ``ValidateLastStep``, ``StopOnSignal``, the
        step progress bar unless configured otherwise, and a ``PredictionsWriter`` for a
        ``predict`` without one; :func:`check_trainer_values` first."""
        config = self._get(self.config_init, "trainer", default={})
        check_trainer_values(config)
        given = config.get("callbacks")
        callbacks = [] if given is None else list(given) if isinstance(given, list) else [given]
        self.run_tag = RunId(new_run_id())
        callbacks.insert(0, self.run_tag)
        callbacks += [ValidateLastStep(), StopOnSignal()]
        if self.subcommand == "predict" and not any(
            isinstance(callback, BasePredictionWriter) for callback in callbacks
        ):
            callbacks.append(PredictionsWriter())
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(callback, ProgressBar) for callback in callbacks
        ):
            callbacks.append(progress_bar())
        return super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})

    def _run_subcommand(self, subcommand: str) -> None:
        # Lightning's, inside the run folder's lock and with the checkpoint path resolved
        with self._run_folder(subcommand):
            try:
                super()._run_subcommand(subcommand)
            except TrainingDiverged as err:
                raise TrainingDiverged(f"{err} {last_good_checkpoint(self.trainer)}",
                                       err.step) from err

    @contextmanager
    def _run_folder(self, subcommand: str) -> Iterator[None]:
        """Run the checks of :mod:`longnet.cli.run_checks`, resolve ``ckpt_path`` and hold the
        run folder's lock (rank 0) while the subcommand runs."""
        trainer, arguments = self.trainer, self.config_init[subcommand]
        folder = run_folder(trainer)
        check_default_root_dir(trainer, arguments["trainer"].get("default_root_dir"),
                               self.root_dir_given)
        check_outputs(trainer, subcommand)
        check_batches_to_run(trainer, subcommand)
        if subcommand == "fit":
            check_overfit_batches(trainer, self.model)
        ckpt_path = arguments.get("ckpt_path")
        continues_run = False
        if ckpt_path is not None:
            ckpt_path, continues_run = self._checked_ckpt_path(str(ckpt_path), subcommand)
            arguments["ckpt_path"] = ckpt_path
        elif subcommand != "fit":
            check_trained_weights(self.model, subcommand, trainer)
        lock = RunLock(folder, self.run_tag.run_id) if trainer.is_global_zero else None
        if lock is not None:
            lock.acquire()
        try:
            if trainer.is_global_zero and subcommand == "fit" and not continues_run:
                refuse_earlier_run(folder, checkpoint_dirs(trainer))
            yield
        finally:
            if lock is not None:
                lock.release()

    def _checked_ckpt_path(self, ckpt_path: str, subcommand: str) -> tuple[str | None, bool]:
        """``ckpt_path`` resolved and checked, and whether it continues this folder's run (a
        ``fit`` from this folder's checkpoint keeps its run id; from another's, a new run)."""
        trainer = self.trainer
        if ckpt_path in ("", "best", "hpc") or "://" in ckpt_path:
            return check_keyword(trainer, ckpt_path, subcommand), False
        if ckpt_path == "last":
            found = run_last_checkpoint(trainer, subcommand)
            if found is None:
                return None, False
            ckpt_path = str(found)
        if not (Path(ckpt_path).is_file() or is_sharded_checkpoint(ckpt_path)):
            raise UsageError(f"--ckpt_path {ckpt_path}: no checkpoint file (or folder of "
                             f"shards) there. {checkpoints_hint(trainer)}")
        checkpoint = read_checkpoint(ckpt_path, tensors=False)
        check_checkpoint_shape(ckpt_path, checkpoint, self.model)
        own = Path(ckpt_path).resolve().parent in {
            folder.resolve() for folder in checkpoint_dirs(trainer)}
        if subcommand == "fit":
            previous, step = checkpoint_run_id(checkpoint), checkpoint.get("global_step")
            check_steps_left(ckpt_path, step, trainer.max_steps)
            if own and previous:
                self.run_tag.run_id = previous
            if trainer.is_global_zero:
                if own:
                    print(f"Resuming run {self.run_tag.run_id} from {ckpt_path} (step {step}).")
                else:
                    of = f" of run {previous}" if previous else ""
                    print(f"Starting run {self.run_tag.run_id} from {ckpt_path} (step {step}"
                          f"{of}, another folder's checkpoint).")
        return ckpt_path, own

    def after_fit(self) -> None:
        trainer = self.trainer
        cut = max_time_cut(trainer, self.config[self.subcommand]["trainer"].get("max_time"))
        if trainer.global_step == 0:
            if trainer.is_global_zero:
                print("fit took no optimizer step: no trained weights, so no test_after_fit.")
        elif self.config[self.subcommand].get("test_after_fit") and not trainer.interrupted:
            best = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
            trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best)
        folder = run_dir(trainer)  # on every rank: log_dir is a collective
        if trainer.is_global_zero:
            print(describe_run(folder, cut is not None))
            splits = getattr(self.datamodule, "splits", None)
            comparison = gzip_comparison(folder, getattr(splits, "gzip_bits_per_byte", {}))
            if comparison is not None:
                print(comparison)
            if cut is not None:
                print(cut, file=sys.stderr)

    def predict(self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None,
                **kwargs) -> object:
        """``trainer.predict`` (of the test split when there is no predict split)."""
        if datamodule is not None and not is_overridden(
            "predict_dataloader", datamodule, L.LightningDataModule
        ):
            datamodule.prepare_data()
            datamodule.setup("predict")
            kwargs["dataloaders"] = datamodule.test_dataloader()
        else:
            kwargs["datamodule"] = datamodule
        predictions = self.trainer.predict(model, **kwargs)
        self._name_predictions()
        return predictions

    def _name_predictions(self) -> None:
        """Print ``Predictions: <files>`` of every ``PredictionsWriter`` (on rank 0)."""
        trainer = self.trainer
        folders = {Path(writer.dirpath) if writer.dirpath else run_dir(trainer)  # every rank
                   for writer in trainer.callbacks if isinstance(writer, PredictionsWriter)}
        if trainer.is_global_zero:
            for folder in sorted(folders):
                files = sorted(map(str, folder.glob("predictions-*.jsonl")))
                print(f"Predictions: {', '.join(files) or f'none written in {folder}'}")
