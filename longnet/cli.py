"""The ``longnet`` command: ``longnet fit|validate|test|predict --config configs/X.yaml``.

A :class:`~lightning.pytorch.cli.LightningCLI` over :class:`longnet.training.CausalLMModule`
(or a subclass) and any ``LightningDataModule`` (``class_path``/``init_args`` in YAML), with:

- ``--test_after_fit true``: after ``fit``, ``test`` the best checkpoint in the same process,
  so one command trains, validates, tests and (with ``ExportPretrained``) exports;
- after ``fit``, a list of what the run folder holds (model export, curves, metrics, ...);
- the resolved config saved in the run folder (the logger's ``log_dir``) of every run:
  ``config.yaml`` for ``fit`` (overwritten when a run is resumed), ``config-<stage>.yaml``
  for the other subcommands;
- ``predict`` on a datamodule without a predict split scores its test split (per-sample
  summed cross-entropy, tokens and bits per byte; add ``longnet.training.PredictionsWriter``
  to the callbacks to write them);
- one run per run folder (``longnet.training.runs``): every subcommand holds
  ``<run folder>/run.lock`` while it works (a second command into the folder is refused,
  naming the live one), a new ``fit`` refuses a folder holding another run's checkpoints or
  export, every metrics row and checkpoint carries the run id, and ``--ckpt_path last`` is
  this folder's ``checkpoints/last.ckpt`` (the command says which checkpoint and step it
  resumes);
- every expected failure (configuration errors, unusable data or checkpoint files, settings
  Lightning or the strategy refuse) reported in a few lines on stderr, naming the value and
  the fix, with exit status 2 and no traceback (``--verbose``, anywhere on the command line,
  prints it); unexpected errors keep their traceback;
- progress in optimizer steps (``longnet.training.progress``): a tqdm bar on a terminal, plain
  lines when stdout is a file or pipe; Lightning's advertisement tips are not shown;
- subnormal floats flushed to zero on the CPU (``longnet.denormals``: a float32 step
  of a trained model ran 2.5x faster; ``LONGNET_KEEP_DENORMALS=1`` keeps them).

``longnet --help`` and ``longnet fit --help`` list everything; ``--print_config`` prints the
resolved config.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.model_helpers import is_overridden

from longnet.denormals import denormals_kept, flushing_denormals
from longnet.training import CausalLMModule
from longnet.training.callbacks import run_dir
from longnet.training.checkpoint import is_sharded_checkpoint, last_checkpoint, read_checkpoint
from longnet.training.progress import progress_bar
from longnet.training.runs import (
    RunId,
    RunLock,
    checkpoint_dirs,
    checkpoint_run_id,
    earlier_run_outputs,
    new_run_id,
    run_folder,
)
from longnet.validation import UsageError

VERBOSE_FLAG = "--verbose"
USAGE_EXIT = 2


class ConfigError(Exception):
    """A run's configuration cannot be instantiated (raised before any work)."""


EXPECTED_ERRORS = (ConfigError, UsageError, MisconfigurationException)
"""What ``main`` reports in a few lines with exit status 2; anything else is a bug and keeps
its traceback."""


class RunConfigSaver(SaveConfigCallback):
    """Save the resolved config as ``config.yaml`` (fit) or ``config-<stage>.yaml``."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        stage = getattr(stage, "value", stage)  # a TrainerFn or its string value
        self.config_filename = "config.yaml" if stage == "fit" else f"config-{stage}.yaml"
        super().setup(trainer, pl_module, stage)


class LongNetCLI(LightningCLI):
    """LightningCLI for LongNet causal-LM training; see the module docstring."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            CausalLMModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=RunConfigSaver,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"description": "LongNet dilated-attention LMs: train, evaluate. "
                           f"{VERBOSE_FLAG} (anywhere): show the traceback of an error."},
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
        """Lightning's; then a ``--ckpt_path`` file is checked (a clear error for random bytes,
        a truncated or a foreign file) before Lightning reads its hyper-parameters."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            read_checkpoint(ckpt_path)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
            raise ConfigError(f"{type(err).__name__}: {err}") from err

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """Lightning's, plus :class:`RunId` first among the callbacks and, unless the config
        disables the bar or brings its own, :func:`~longnet.training.progress.progress_bar`."""
        config = self._get(self.config_init, "trainer", default={})
        given = config.get("callbacks")
        callbacks = [] if given is None else list(given) if isinstance(given, list) else [given]
        self.run_tag = RunId(new_run_id())
        callbacks.insert(0, self.run_tag)
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(callback, ProgressBar) for callback in callbacks
        ):
            callbacks.append(progress_bar())
        return super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})

    def _run_subcommand(self, subcommand: str) -> None:
        # Lightning's, inside the run folder's lock and with the checkpoint path resolved
        with self._run_folder(subcommand):
            super()._run_subcommand(subcommand)

    @contextmanager
    def _run_folder(self, subcommand: str) -> Iterator[None]:
        """Resolve ``ckpt_path``, take the run folder's lock (rank 0), refuse a new ``fit`` in
        a folder with another run's outputs; release the lock when the subcommand ends."""
        trainer, arguments = self.trainer, self.config_init[subcommand]
        folder = run_folder(trainer)
        ckpt_path = arguments.get("ckpt_path")
        if ckpt_path is not None:
            ckpt_path = arguments["ckpt_path"] = self._checked_ckpt_path(str(ckpt_path), subcommand)
        lock = RunLock(folder, self.run_tag.run_id) if trainer.is_global_zero else None
        if lock is not None:
            lock.acquire()
        try:
            if trainer.is_global_zero and subcommand == "fit" and ckpt_path is None:
                refuse_earlier_run(folder, checkpoint_dirs(trainer))
            yield
        finally:
            if lock is not None:
                lock.release()

    def _checked_ckpt_path(self, ckpt_path: str, subcommand: str) -> str | None:
        """``ckpt_path`` checked: ``last`` is this run folder's ``last.ckpt`` (none yet: a new
        run for ``fit``, an error otherwise), ``best`` needs a ``fit`` in this command, a path
        must be a readable Lightning checkpoint. A resumed ``fit`` keeps the run id of its
        checkpoint and says which file and step it resumes."""
        trainer = self.trainer
        if ckpt_path in ("best", "hpc") or "://" in ckpt_path:
            return check_keyword(trainer, ckpt_path, subcommand)
        if ckpt_path == "last":
            found = run_last_checkpoint(trainer, subcommand)
            if found is None:
                return None
            ckpt_path = str(found)
        if not (Path(ckpt_path).is_file() or is_sharded_checkpoint(ckpt_path)):
            raise UsageError(f"--ckpt_path {ckpt_path}: no checkpoint file (or folder of "
                             f"shards) there. {checkpoints_hint(trainer)}")
        checkpoint = read_checkpoint(ckpt_path, tensors=False)
        if subcommand == "fit":
            self.run_tag.run_id = checkpoint_run_id(checkpoint) or self.run_tag.run_id
            if trainer.is_global_zero:
                print(f"Resuming run {self.run_tag.run_id} from {ckpt_path} "
                      f"(step {checkpoint.get('global_step')}).")
        return ckpt_path

    def after_fit(self) -> None:
        if self.trainer.global_step == 0:
            if self.trainer.is_global_zero:
                print("fit took no optimizer step: no trained weights, so no test_after_fit.")
        elif self.config[self.subcommand].get("test_after_fit") and not self.trainer.interrupted:
            best = getattr(self.trainer.checkpoint_callback, "best_model_path", "") or None
            self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best)
        folder = run_dir(self.trainer)  # on every rank: log_dir is a collective
        if self.trainer.is_global_zero:
            print(describe_run(folder))

    def predict(self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None,
                **kwargs) -> object:
        """``trainer.predict``; a datamodule without a predict split predicts its test split."""
        if datamodule is not None and not is_overridden(
            "predict_dataloader", datamodule, L.LightningDataModule
        ):
            datamodule.prepare_data()
            datamodule.setup("predict")
            return self.trainer.predict(model, dataloaders=datamodule.test_dataloader(), **kwargs)
        return self.trainer.predict(model, datamodule=datamodule, **kwargs)


def refuse_earlier_run(folder: Path, checkpoint_folders: list[Path]) -> None:
    """Raise :class:`UsageError` if ``folder`` holds another run's checkpoints or export."""
    found = earlier_run_outputs(folder, checkpoint_folders)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UsageError(
            f"run folder {folder} holds an earlier run ({shown}). Continue it with "
            "--ckpt_path last, give this run its own folder with "
            "--trainer.logger.init_args.name <new name>, or delete the folder."
        )


def run_last_checkpoint(trainer: L.Trainer, subcommand: str) -> Path | None:
    """This run folder's complete ``last.ckpt`` (a file, or a folder of shards whose writing
    finished) of the first ``ModelCheckpoint`` with ``save_last`` that has one: never another
    folder's, never a ``last-v1.ckpt``. None for a ``fit`` without one (it starts a new run, so
    a command with ``--ckpt_path last`` can be re-run as it is, e.g. by ``torchrun
    --max-restarts``); other subcommands raise :class:`UsageError`."""
    folders = checkpoint_dirs(trainer, save_last=True)
    candidates = [folder / "last.ckpt" for folder in folders]
    found = next((path for path in map(last_checkpoint, folders) if path is not None), None)
    if found is not None:
        return found
    where = ", ".join(map(str, candidates)) or "(no ModelCheckpoint with save_last)"
    if subcommand != "fit":
        raise UsageError(f"--ckpt_path last: no last checkpoint at {where}. "
                         f"{checkpoints_hint(trainer)}")
    if trainer.is_global_zero:
        print(f"--ckpt_path last: no last checkpoint at {where}: starting a new run.")
    return None


def check_keyword(trainer: L.Trainer, ckpt_path: str, subcommand: str) -> str:
    """``best`` needs a best checkpoint from a ``fit`` in this process; ``hpc`` and URLs are
    Lightning's to resolve."""
    if ckpt_path == "best" and (
        subcommand == "fit" or not getattr(trainer.checkpoint_callback, "best_model_path", "")
    ):
        raise UsageError(
            "--ckpt_path best: there is no best checkpoint of a fit in this command; give the "
            f"file. {checkpoints_hint(trainer)}"
        )
    return ckpt_path


def checkpoints_hint(trainer: L.Trainer) -> str:
    """``Checkpoints of this run folder: ...`` (or that there are none)."""
    found = sorted(str(path) for folder in checkpoint_dirs(trainer) for path in
                   folder.glob("*.ckpt"))
    if not found:
        return f"The run folder {run_folder(trainer)} has no checkpoints."
    return "Checkpoints of this run folder: " + ", ".join(found[:6]) + "."


def describe_run(folder: Path) -> str:
    """Lines naming what a run left in its folder (only the files that exist)."""
    outputs = (
        ("model/", "trained model: LongNetLM.from_pretrained({path!r})"),
        ("curves.png", "training curves (bits per byte vs step)"),
        ("metrics.json", "final validation and test metrics"),
        ("metrics.csv", "every logged value"),
        ("config.yaml", "the resolved config"),
        ("checkpoints/", "Lightning checkpoints (fit --ckpt_path last resumes)"),
    )
    lines = [f"Run folder {folder}:"]
    for name, what in outputs:
        path = folder / name
        if path.exists():
            lines.append(f"  {str(path) + ('/' if path.is_dir() else ''):<40} "
                         f"{what.format(path=str(path))}")
    return "\n".join(lines)


def run_cli(args: Sequence[str] | None = None) -> LongNetCLI:
    """Run the CLI in-process and return it (``cli.trainer``, ``cli.model``, ...)."""
    return LongNetCLI(args=args)


class _NoTips(logging.Filter):
    """Drop Lightning's advertisement tips ("💡 Tip: ... litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def quiet_lightning() -> None:
    """No advertisement tips, and none of the warnings every run would print that a user
    cannot act on: the deprecation warning of Lightning's pytree helper with this torch, and
    the non-empty checkpoint folder of a resumed run."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # a resumed fit writes into its own checkpoint folder; a new one never gets there
    # (longnet.training.runs refuses a folder with another run's checkpoints)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def error_message(err: BaseException) -> str:
    """The lines ``main`` prints for an expected error."""
    if isinstance(err, ConfigError):
        what = f"configuration error: {err}"
    elif isinstance(err, MisconfigurationException):
        what = f"Lightning refused the settings: {err}"
    else:
        what = f"error: {err}"
    return f"longnet: {what}\n(run again with {VERBOSE_FLAG} to see the traceback)"


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status: 0, or 2 for an expected error
    (:data:`EXPECTED_ERRORS`, reported without a traceback unless ``--verbose`` is given)."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = VERBOSE_FLAG in argv
    argv = [arg for arg in argv if arg != VERBOSE_FLAG]
    if args is None:
        sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and warns if given args too)
    quiet_lightning()
    # first thing, before any parallel torch operation (longnet.denormals)
    with flushing_denormals(not denormals_kept()):
        try:
            run_in_own_context(None if args is None else argv)
        except EXPECTED_ERRORS as err:
            if verbose:
                traceback.print_exc()
            print(error_message(err), file=sys.stderr)
            return USAGE_EXIT
    return 0


def run_in_own_context(args: Sequence[str] | None) -> None:
    """Run the CLI in a copy of the context, dropped on return.

    jsonargparse leaves its last subcommand parser in a context variable, and the parser
    reaches the CLI, its trainer, strategy and process groups. Left there, a distributed run's
    process groups would outlive the exit hook that destroys them
    (:func:`~longnet.training.strategy.destroy_process_group_at_exit`) and be freed only while
    the interpreter shuts down, where gloo can abort a process whose run finished
    ("terminate called without an active exception"; docs/training.md, "A lost rank")."""
    contextvars.copy_context().run(run_cli, args)


if __name__ == "__main__":
    sys.exit(main())
