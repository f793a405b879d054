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
- one run per run folder (``longnet.training.runs``): every subcommand checks that the run
  folder (and every other output folder) can be written and holds ``<run folder>/run.lock``
  while it works (a second command into the folder is refused, naming the live one), a new
  ``fit`` refuses a folder holding another run's checkpoints or export, every metrics row and
  checkpoint carries the run id, and ``--ckpt_path last`` is this folder's
  ``checkpoints/last.ckpt`` (the command says which checkpoint and step it resumes; a
  checkpoint of another folder starts a new run from it);
- the model is the configured one: Lightning's CLI would replace it by the hyper-parameters
  stored in a ``--ckpt_path`` file; here a checkpoint whose tensors have other shapes than the
  configured model's is refused, naming both;
- every expected failure (configuration errors, unusable data or checkpoint files, settings
  Lightning or the strategy refuse, a run folder that cannot be written, a checkpoint of
  another model shape, a diverged training) reported in a few lines on stderr, naming the
  value and the fix, with exit status 2 and no traceback (``--verbose``, anywhere on the
  command line, prints it; for a parser error, its whole message); unexpected errors keep
  their traceback;
- ``trainer.precision: auto``: bf16-mixed where the hardware multiplies bfloat16 natively,
  else 32-true (``longnet.training.precision``; one log line says which and why);
- SIGTERM / SIGINT: the run stops at the end of its step with ``last.ckpt``, one line says how
  to resume, exit status 143 / 130 (``longnet.training.signals``); a run stopped by
  ``max_time`` before ``max_steps`` says so, and what to do, after its summary;
- progress in optimizer steps (``longnet.training.progress``): a tqdm bar on a terminal, plain
  lines when stdout is a file or pipe; Lightning's advertisement tips are not shown;
- subnormal floats flushed to zero on the CPU (``longnet.denormals``: a float32 step
  of a trained model ran 2.5x faster; ``LONGNET_KEEP_DENORMALS=1`` keeps them).

``longnet --help`` and ``longnet fit --help`` list everything; ``--print_config`` prints the
resolved config.
"""

from __future__ import annotations

import contextvars
import difflib
import importlib
import inspect
import logging
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar, Timer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden

from longnet.denormals import denormals_kept, flushing_denormals
from longnet.files import check_output_folder, write_atomic
from longnet.training import CausalLMModule
from longnet.training.callbacks import ValidateLastStep, run_dir
from longnet.training.checkpoint import (
    checkpoint_config,
    checkpoint_shapes,
    is_sharded_checkpoint,
    last_checkpoint,
    read_checkpoint,
)
from longnet.training.module import TrainingDiverged
from longnet.training.precision import AutoPrecisionTrainer
from longnet.training.progress import progress_bar
from longnet.training.runs import (
    LOCK_NAME,
    RunId,
    RunLock,
    checkpoint_dirs,
    checkpoint_run_id,
    earlier_run_outputs,
    new_run_id,
    run_folder,
)
from longnet.training.signals import (
    RERUN_HINT,
    Interrupted,
    StopOnSignal,
    exit_status,
    raising_on_signals,
    signal_name,
)
from longnet.validation import UsageError

VERBOSE_FLAG = "--verbose"
USAGE_EXIT = 2
SUBCOMMANDS = ("fit", "validate", "test", "predict")
RUN_FILES = (LOCK_NAME, "config.yaml", "metrics.json", "metrics.csv", "curves.png")
"""Files the command writes directly in the run folder (checked writable before any work)."""


class ConfigError(Exception):
    """A run's configuration cannot be instantiated (raised before any work)."""


EXPECTED_ERRORS = (ConfigError, UsageError, MisconfigurationException)
"""What ``main`` reports in a few lines with exit status 2; anything else is a bug and keeps
its traceback."""


class RunConfigSaver(SaveConfigCallback):
    """Save the resolved config as ``config.yaml`` (fit) or ``config-<stage>.yaml``, written
    whole or not at all (:func:`longnet.files.write_atomic`)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        stage = getattr(stage, "value", stage)  # a TrainerFn or its string value
        name = "config.yaml" if stage == "fit" else f"config-{stage}.yaml"
        folder = run_dir(trainer)  # on every rank: log_dir is a collective
        if trainer.is_global_zero:
            write_atomic(folder / name, self.parser.dump(self.config, skip_none=False))
        self.already_saved = True


class LongNetCLI(LightningCLI):
    """LightningCLI for LongNet causal-LM training; see the module docstring."""

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
        """Lightning's, with a clear error for a config file that is not text; then a
        ``--ckpt_path`` file is checked (a clear error for random bytes, a truncated or a
        foreign file)."""
        try:
            super().parse_arguments(parser, args)
        except UnicodeDecodeError as err:
            raise UsageError(undecodable_config(sys.argv[1:] if args is None else args, err)) \
                from err
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            read_checkpoint(ckpt_path)

    def _parse_ckpt_path(self) -> None:
        """Keep the configured model. (Lightning's CLI replaces the model's arguments by the
        hyper-parameters stored in a ``--ckpt_path`` file, command line included, so that a
        checkpoint of another shape silently became the model; ``_run_folder`` refuses such a
        checkpoint instead.)"""

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
            raise ConfigError(f"{type(err).__name__}: {err}") from err

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """Lightning's, plus :class:`RunId` first among the callbacks,
        :class:`~longnet.training.callbacks.ValidateLastStep`, :class:`StopOnSignal` and,
        unless the config disables the bar or brings its own,
        :func:`~longnet.training.progress.progress_bar`."""
        config = self._get(self.config_init, "trainer", default={})
        given = config.get("callbacks")
        callbacks = [] if given is None else list(given) if isinstance(given, list) else [given]
        self.run_tag = RunId(new_run_id())
        callbacks.insert(0, self.run_tag)
        callbacks += [ValidateLastStep(), StopOnSignal()]
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
        """Check that the outputs can be written, resolve ``ckpt_path``, take the run folder's
        lock (rank 0), refuse a new ``fit`` in a folder with another run's outputs; release the
        lock when the subcommand ends."""
        trainer, arguments = self.trainer, self.config_init[subcommand]
        folder = run_folder(trainer)
        check_outputs(trainer, subcommand)
        ckpt_path = arguments.get("ckpt_path")
        continues_run = False
        if ckpt_path is not None:
            ckpt_path, continues_run = self._checked_ckpt_path(str(ckpt_path), subcommand)
            arguments["ckpt_path"] = ckpt_path
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
        """``ckpt_path`` checked, and whether it continues this folder's run: ``last`` is this
        run folder's ``last.ckpt`` (none yet: a new run for ``fit``, an error otherwise),
        ``best`` needs a ``fit`` in this command, a path must be a readable Lightning
        checkpoint of the configured model's shape. A ``fit`` from a checkpoint of this
        folder keeps its run id and says which file and step it resumes; from another
        folder's, it is a new run (a new id) that starts from it."""
        trainer = self.trainer
        if ckpt_path in ("best", "hpc") or "://" in ckpt_path:
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
            if cut is not None:
                print(cut, file=sys.stderr)

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


def check_outputs(trainer: L.Trainer, subcommand: str) -> None:
    """Refuse, before any work, a run folder (or another output folder of the callbacks:
    checkpoints, exports, predictions) that cannot be written (:class:`UsageError`)."""
    folder = run_folder(trainer)
    what = "run folder (--trainer.logger.init_args.save_dir and name)"
    check_output_folder(folder, (*RUN_FILES, f"config-{subcommand}.yaml"), what=what)
    others = set(checkpoint_dirs(trainer)) | {
        Path(callback.dirpath) for callback in trainer.callbacks
        if isinstance(getattr(callback, "dirpath", None), (str, Path))}
    for path in sorted(others - {folder}):
        check_output_folder(path, what="output folder")


def check_checkpoint_shape(ckpt_path: str, checkpoint: dict[str, Any],
                           module: L.LightningModule) -> None:
    """Refuse a checkpoint whose tensors differ from ``module``'s (missing, unexpected, other
    shapes), naming both models' differing config fields and the fix."""
    expected = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    found = checkpoint_shapes(ckpt_path, checkpoint)
    shaped = sorted(name for name in expected.keys() & found.keys()
                    if expected[name] != found[name])
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected)
    if not (shaped or missing or unexpected):
        return
    examples = [f"{name}: {found[name]} in the checkpoint, {expected[name]} configured"
                for name in shaped[:2]]
    examples += [f"{len(missing)} configured tensors absent (e.g. {missing[0]})"] if missing else []
    examples += [f"{len(unexpected)} unknown tensors (e.g. {unexpected[0]})"] if unexpected else []
    config = Path(ckpt_path).resolve().parent.parent / "config.yaml"
    matching = f" ({config})" if config.is_file() else ""
    raise UsageError(
        f"--ckpt_path {ckpt_path} holds a model of another shape than the configured one: "
        f"{config_difference(checkpoint, module)}({'; '.join(examples)}). Use the config it "
        f"was trained with{matching}, or drop the --model.init_args.overrides that change the "
        "model's shape."
    )


def config_difference(checkpoint: dict[str, Any], module: L.LightningModule) -> str:
    """``checkpoint {a: 1, b: 2}, configured {a: 3, b: 4} `` for the config fields in which the
    checkpoint's model and ``module``'s differ (empty when either is unknown)."""
    configured = getattr(getattr(module, "model", None), "config", None)
    try:
        stored = checkpoint_config(checkpoint)
    except (ValueError, OSError):
        return ""
    if configured is None:
        return ""
    ours, theirs = configured.to_dict(), stored.to_dict()
    fields = [key for key in ours if ours.get(key) != theirs.get(key)]

    def shown(values: dict[str, Any]) -> str:
        return "{" + ", ".join(f"{key}: {values.get(key)}" for key in fields) + "}"

    return f"checkpoint {shown(theirs)}, configured {shown(ours)} " if fields else ""


def last_good_checkpoint(trainer: L.Trainer) -> str:
    """``Last good checkpoint: <path> (step N).`` of this run folder (or that there is none)."""
    for folder in checkpoint_dirs(trainer, save_last=True):
        found = last_checkpoint(folder)
        if found is not None:
            step = read_checkpoint(found, tensors=False).get("global_step")
            return f"Last good checkpoint: {found} (step {step})."
    return "No checkpoint was written before it."


def max_time_cut(trainer: L.Trainer, max_time: Any) -> str | None:
    """The warning for a ``fit`` that ``max_time`` stopped before ``max_steps`` (None when it
    was not stopped by it)."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is None or trainer.max_steps < 0 or trainer.global_step >= trainer.max_steps:
        return None
    remaining = timer.time_remaining(RunningStage.TRAINING)
    if remaining is None or remaining > 0:
        return None
    return (
        f"longnet: WARNING: max_time ({max_time}) stopped the training at step "
        f"{trainer.global_step} of {trainer.max_steps}, before its learning-rate schedule "
        "ended: the model is under-trained.\n"
        "  To finish it, run the same command with --ckpt_path last --trainer.max_time null;\n"
        "  to fit the time, train fewer steps (--trainer.max_steps) or check the precision "
        "and the machine's load (other processes on its cores)."
    )


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


def describe_run(folder: Path, cut: bool = False) -> str:
    """Lines naming what a run left in its folder (only the files that exist); ``cut``: the
    training was stopped by ``max_time`` (the model is not called trained)."""
    model = ("model stopped by max_time, under-trained" if cut else "trained model")
    outputs = (
        ("model/", model + ": LongNetLM.from_pretrained({path!r})"),
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


# ---------------------------------------------------------------------- error messages
def undecodable_config(args: Sequence[str], err: UnicodeDecodeError) -> str:
    """The message for a file given on the command line that is not UTF-8 text (a config)."""
    for arg in args:
        for candidate in (arg, arg.partition("=")[2]):
            path = Path(candidate)
            if candidate and path.is_file():
                try:
                    path.read_text(encoding="utf-8")
                except UnicodeDecodeError as bad:
                    return (f"{path} is not a text config file ({bad.reason} at byte "
                            f"{bad.start}): give a YAML or JSON config, e.g. "
                            "configs/smoke.yaml.")
    return f"a file given on the command line is not UTF-8 text ({err}); configs are YAML."


def parse_error_message(message: str) -> str:
    """jsonargparse's error shortened to what matters: ``--key: reason`` (the innermost
    failing key, the reason for the value given, without the alternatives that do not
    apply)."""
    lines = [(len(line) - len(line.lstrip()), line.strip()) for line in message.splitlines()
             if line.strip()]
    if not lines:
        return message
    keys, reason = _explain(lines)
    return f"--{'.'.join(keys)}: {reason}" if keys else reason


def _items(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split a ``- first line`` list (with indented continuations) into items, the dash
    removed."""
    items: list[list[tuple[int, str]]] = []
    indent = lines[0][0] if lines else 0
    for level, text in lines:
        if level == indent and text.startswith("- "):
            items.append([(level + 2, text[2:])])
        elif items:  # a continuation at the dash's indent belongs to the item's own block
            items[-1].append((level + 2 if level == indent else level, text))
    return items


def _explain(lines: list[tuple[int, str]]) -> tuple[list[str], str]:
    """(keys, reason) of one error block."""
    text = lines[0][1]
    if match := re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', text):
        rest = [(lines[0][0] + 2, match.group(2))] if match.group(2) else []
        inner = rest + lines[1:]
        keys, reason = _explain(inner) if inner else ([], "invalid value")
        return [match.group(1), *keys], reason
    if text.startswith("- "):  # alternatives at this level (e.g. a path or a class)
        return _best(_items(lines), given=None)
    if text.startswith("Does not validate against any of the Union subtypes"):
        level = lines[0][0]  # of this block's own lines ("Errors:", "Given value: ...")
        own = [i for i, (at, _) in enumerate(lines) if at == level]
        errors = next((i for i in own if lines[i][1] == "Errors:"), len(lines))
        end = next((i for i in own if i > errors and lines[i][1].startswith("Given value")),
                   len(lines))
        given = next((lines[i][1].removeprefix("Given value: ") for i in own
                      if lines[i][1].startswith("Given value: ")), None)
        return _best(_items(lines[errors + 1:end]), given)
    if match := re.fullmatch(r"Problem with given class_path '([^']+)':", text):
        keys, reason = _explain(lines[1:]) if len(lines) > 1 else ([], text)
        if keys:
            return ["init_args", *keys], reason
        return [], _with_suggestion(reason, match.group(1))
    return [], " ".join(t for _, t in lines)


def _best(items: list[list[tuple[int, str]]], given: str | None) -> tuple[list[str], str]:
    """The reason among a union's alternatives: a class's own error first, else what the
    value should have been."""
    items = [item for item in items if item[0][1] != "Expected a <class 'NoneType'>"]
    for prefix in ("Problem with given class_path", "Does not validate against any"):
        for item in items:
            if item[0][1].startswith(prefix):
                return _explain(item)
    expected = [item[0][1].removeprefix("Expected a ") for item in items
                if item[0][1].startswith("Expected a ")]
    if expected and given is not None and len(expected) == len(items):
        return [], f"{given!r} is not {_one_of(expected)}"
    if items:
        return _explain(items[0])
    return [], f"invalid value {given!r}"


def _one_of(types: list[str]) -> str:
    """``one of 64, 32, 'bf16-mixed'`` / ``an int`` from jsonargparse's type names."""
    literals, others = [], []
    for name in types:
        if name.startswith("typing.Literal[") and name.endswith("]"):
            literals.append(name[len("typing.Literal["):-1])
        else:
            others.append(re.sub(r"<class '([\w.]+)'>", r"\1", name))
    parts = ([f"one of {', '.join(literals)}"] if literals else []) + [f"a {o}" for o in others]
    return " or ".join(parts)


def _with_suggestion(reason: str, class_path: str) -> str:
    """``Option 'x' is not accepted`` of ``class_path``, with the closest accepted names."""
    match = re.fullmatch(r"Option '([^']+)' is not accepted", reason)
    if match is None:
        return f"{reason} ({class_path})"
    module, _, name = class_path.rpartition(".")
    try:
        accepted = list(inspect.signature(getattr(importlib.import_module(module), name))
                        .parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        accepted = []
    close = difflib.get_close_matches(match.group(1), accepted, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"{class_path} has no option {match.group(1)!r}{hint}"


def error_message(err: BaseException) -> str:
    """The lines ``main`` prints for an expected error."""
    if isinstance(err, ConfigError):
        what = f"configuration error: {err}"
    elif isinstance(err, MisconfigurationException):
        what = f"Lightning refused the settings: {err}"
    else:
        what = f"error: {err}"
    return f"longnet: {what}\n(run again with {VERBOSE_FLAG} to see the traceback)"


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


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status: 0; 2 for an expected error
    (:data:`EXPECTED_ERRORS` and parser errors, reported in a few lines without a traceback
    unless ``--verbose`` is given); ``128 + signal`` for a run stopped by SIGTERM (143) or
    SIGINT (130)."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = VERBOSE_FLAG in argv
    argv = [arg for arg in argv if arg != VERBOSE_FLAG]
    if args is None:
        sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and warns if given args too)
    quiet_lightning()
    # first thing, before any parallel torch operation (longnet.denormals)
    with flushing_denormals(not denormals_kept()), raising_on_signals():
        try:
            run_in_own_context(None if args is None else argv)
        except ArgumentError as err:
            subcommand = next((arg for arg in argv if arg in SUBCOMMANDS), None)
            help_command = " ".join(filter(None, ["longnet", subcommand, "--help"]))
            shown = str(err) if verbose else parse_error_message(str(err))
            print(f"longnet: error: {shown}\n(run {help_command} for the options"
                  + ("" if verbose else f"; add {VERBOSE_FLAG} for the parser's whole message")
                  + ")", file=sys.stderr)
            return USAGE_EXIT
        except EXPECTED_ERRORS as err:
            if verbose:
                traceback.print_exc()
            print(error_message(err), file=sys.stderr)
            return USAGE_EXIT
        except SIGTERMException as stop:  # StopOnSignal said where it stopped
            code = stop.code
            return code if isinstance(code, int) and code else exit_status(signal.SIGTERM)
        except Interrupted as err:
            print(f"longnet: interrupted by {signal_name(err.signum)}. {RERUN_HINT}",
                  file=sys.stderr)
            return exit_status(err.signum)
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
