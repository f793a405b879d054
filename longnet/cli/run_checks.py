"""The ``longnet`` command's checks of a run folder and its checkpoints before the work
(outputs writable, ``--trainer.default_root_dir``, ``--ckpt_path`` resolved and of the model's
shape, trained weights and batches to evaluate, no earlier run overwritten), and what a run
left behind afterwards. The run folder's lock and run ids are ``longnet.training.run_folder``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.trainer.states import RunningStage

from longnet.constants import DELTA_CONFIG
from longnet.files import check_output_folder, check_path_given
from longnet.training.checkpoint import (
    checkpoint_config,
    checkpoint_shapes,
    last_checkpoint,
    read_checkpoint,
)
from longnet.training.run_folder import (
    LOCK_NAME,
    checkpoint_dirs,
    earlier_run_outputs,
    run_folder,
)
from longnet.validation import UsageError

RUN_FILES = (LOCK_NAME, "config.yaml", "metrics.json", "metrics.csv", "curves.png")
"""Files the command writes directly in the run folder."""
CKPT_PATH_VALUES = ("last (this run folder's checkpoints/last.ckpt), best (the best checkpoint "
                    "of a fit in the same command) or the path of a checkpoint file")
"""What ``--ckpt_path`` accepts, for the messages."""
EVALUATION_LIMITS = {"validate": "limit_val_batches", "test": "limit_test_batches",
                     "predict": "limit_predict_batches"}
"""The trainer setting that limits the batches of each subcommand that only evaluates."""


def check_outputs(trainer: L.Trainer, subcommand: str) -> None:
    """Refuse (:class:`UsageError`) a run folder or callback output folder that cannot be
    written, or a callback's empty ``dirpath`` (Lightning would take the current folder)."""
    folder = run_folder(trainer)
    what = "run folder (--trainer.logger.init_args.save_dir and name)"
    check_output_folder(folder, (*RUN_FILES, f"config-{subcommand}.yaml"), what=what)
    for callback in trainer.callbacks:
        if getattr(callback, "dirpath", None) == "":
            raise UsageError(f"{type(callback).__name__} dirpath is empty; give a folder, or "
                             "null for its default in the run folder.")
    others = set(checkpoint_dirs(trainer)) | {
        Path(callback.dirpath) for callback in trainer.callbacks
        if isinstance(getattr(callback, "dirpath", None), (str, Path))}
    for path in sorted(others - {folder}):
        check_output_folder(path, what="output folder")


def check_checkpoint_shape(ckpt_path: str, checkpoint: dict[str, Any],
                           module: L.LightningModule) -> None:
    """Refuse a checkpoint whose tensors differ from ``module``'s, naming how."""
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


def check_steps_left(ckpt_path: str, step: Any, max_steps: int) -> None:
    """Refuse a ``fit`` from a checkpoint already past ``max_steps`` (-1: no limit): it would
    train nothing yet save a ``config.yaml`` with the wrong ``max_steps``."""
    if isinstance(step, int) and 0 <= max_steps < step:
        raise UsageError(
            f"--ckpt_path {ckpt_path} is at step {step}, past --trainer.max_steps {max_steps}: "
            f"a fit from it would train nothing. To train further, raise --trainer.max_steps "
            f"above {step}; to evaluate it, run longnet validate or longnet test with this "
            "--ckpt_path."
        )


def config_difference(checkpoint: dict[str, Any], module: L.LightningModule) -> str:
    """``checkpoint {a: 1}, configured {a: 3} `` for the differing config fields, or ``""``."""
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
    """``Last good checkpoint: <path> (step N).`` of this run folder, or that there is none."""
    for folder in checkpoint_dirs(trainer, save_last=True):
        found = last_checkpoint(folder)
        if found is not None:
            step = read_checkpoint(found, tensors=False).get("global_step")
            return f"Last good checkpoint: {found} (step {step})."
    return "No checkpoint was written before it."


def max_time_cut(trainer: L.Trainer, max_time: Any) -> str | None:
    """The warning for a ``fit`` that ``max_time`` stopped before ``max_steps``, else None."""
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
    """This run folder's complete ``last.ckpt`` (file or finished shards folder), never a
    ``last-v1.ckpt``. None for a ``fit`` without one (a new run, so ``--ckpt_path last``
    commands can be re-run as they are); other subcommands raise :class:`UsageError`."""
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


def check_default_root_dir(trainer: L.Trainer, given: str | None, on_command_line: bool) -> None:
    """Refuse an empty ``trainer.default_root_dir`` (``given``; None: not set), and one given on
    the command line that is neither the run folder nor the logger's ``save_dir`` (Lightning
    would silently ignore it: a run with a logger goes in the logger's folder)."""
    if given is None:
        return
    path = check_path_given(given, "--trainer.default_root_dir")
    logger, folder = trainer.logger, run_folder(trainer)
    if not on_command_line or logger is None:
        return
    accepted = {folder.resolve(), Path(logger.save_dir or folder).resolve()}
    if path.resolve() not in accepted:
        raise UsageError(
            f"--trainer.default_root_dir {given} is not where this run goes: the run folder is "
            f"the logger's, {folder} (<save_dir>/<name>). To run in {given}, give "
            f"--trainer.logger.init_args.save_dir {path.parent} --trainer.logger.init_args.name "
            f"{path.name} instead."
        )


def check_trained_weights(module: L.LightningModule, subcommand: str,
                          trainer: L.Trainer) -> None:
    """Refuse a ``validate``/``test``/``predict`` without ``--ckpt_path`` of a model built from
    a shape (``model:`` or ``config:``): it would score random weights."""
    hparams = getattr(module, "hparams", {})
    if hparams.get("pretrained") is not None or not ({"model", "config"} & set(hparams)):
        return
    source = f"model: {hparams['model']}" if hparams.get("model") else "config:"
    raise UsageError(
        f"longnet {subcommand} without --ckpt_path would use the randomly initialised weights "
        f"of {source} (a model shape, not trained weights). Give the weights to evaluate: "
        "--ckpt_path last|best|PATH (last: this run folder's checkpoints/last.ckpt), or "
        "--model.init_args.pretrained NAME_OR_FOLDER --model.init_args.model null (a "
        f"save_pretrained folder or a trained zoo model). {checkpoints_hint(trainer)}"
    )


def check_batches_to_run(trainer: L.Trainer, subcommand: str) -> None:
    """Refuse a ``validate``/``test``/``predict`` whose batch limit is 0 (nothing to do)."""
    setting = EVALUATION_LIMITS.get(subcommand)
    if setting is not None and getattr(trainer, setting) == 0:
        raise UsageError(
            f"--trainer.{setting} 0 leaves longnet {subcommand} nothing to do; give a number of "
            f"batches, a fraction of the split (1.0: all of it), or leave it unset."
        )


def check_overfit_batches(trainer: L.Trainer, module: L.LightningModule) -> None:
    """Refuse a ``fit`` with ``overfit_batches`` under the resumable data order, whose loaders
    Lightning cannot re-sample."""
    overfit = trainer.overfit_batches
    if overfit and getattr(module, "hparams", {}).get("resumable_data"):
        raise UsageError(
            f"--trainer.overfit_batches {overfit} needs Lightning's own data loaders, which the "
            "resumable data order (model resumable_data: true) replaces: add "
            "--model.init_args.resumable_data false to overfit, or train on a few batches with "
            "--trainer.limit_train_batches N."
        )


def check_keyword(trainer: L.Trainer, ckpt_path: str, subcommand: str) -> str:
    """Refuse an empty ``ckpt_path``, ``hpc`` (not written by this command), and ``best``
    without a best checkpoint of a ``fit`` in this process; URLs are Lightning's."""
    if ckpt_path in ("", "hpc"):
        what = "is empty" if not ckpt_path else (
            "hpc: Lightning's SLURM checkpoints are not written by this command (a stopped "
            "run leaves last.ckpt)")
        raise UsageError(f"--ckpt_path {what}; give {CKPT_PATH_VALUES}. "
                         f"{checkpoints_hint(trainer)}")
    if ckpt_path == "best" and (
        subcommand == "fit" or not getattr(trainer.checkpoint_callback, "best_model_path", "")
    ):
        raise UsageError(
            "--ckpt_path best: there is no best checkpoint of a fit in this command; give the "
            f"file. {checkpoints_hint(trainer)}"
        )
    return ckpt_path


def checkpoints_hint(trainer: L.Trainer) -> str:
    """``Checkpoints of this run folder: ...``, or that there are none."""
    found = sorted(str(path) for folder in checkpoint_dirs(trainer) for path in
                   folder.glob("*.ckpt"))
    if not found:
        return f"The run folder {run_folder(trainer)} has no checkpoints."
    return "Checkpoints of this run folder: " + ", ".join(found[:6]) + "."


def describe_run(folder: Path, cut: bool = False) -> str:
    """Lines naming what a run left in its folder; ``cut``: ``max_time`` stopped the training."""
    model = ("model stopped by max_time, under-trained" if cut else "trained model")
    load = ("LoRA delta: longnet export {path} OUTPUT merges it into its base"
            if (folder / "model" / DELTA_CONFIG).is_file()
            else "LongNetLM.from_pretrained({path!r})")
    outputs = (
        ("model/", f"{model}: {load}"),
        ("curves.png", "training curves (bits per byte vs step)"),
        ("metrics.json", "final validation and test metrics"),
        ("metrics.csv", "every logged value"),
        ("config.yaml", "the resolved config"),
        ("tokenizer/", "the tokenizer the data and the model use (model/ holds it too)"),
        ("checkpoints/", "Lightning checkpoints (fit --ckpt_path last resumes)"),
    )
    lines = [f"Run folder {folder}:"]
    for name, what in outputs:
        path = folder / name
        if path.exists():
            lines.append(f"  {str(path) + ('/' if path.is_dir() else ''):<40} "
                         f"{what.format(path=str(path))}")
    return "\n".join(lines)


def gzip_comparison(folder: Path, gzip: Mapping[str, float]) -> str | None:
    """One line: the run's validation and test bits per byte (``metrics.json``) beside gzip
    -9's (``gzip``: split -> bits per byte) and whether the model beats it; None when either
    is missing."""
    path = folder / "metrics.json"
    if not gzip or not path.is_file():
        return None
    metrics = json.loads(path.read_text())
    parts, below = [], {}
    sections = (("validate", "validation", "val/bpb"), ("test", "test", "test/bpb"))
    for section, split, key in sections:
        value = metrics.get(section, {}).get(key)
        if isinstance(value, float) and split in gzip:
            parts.append(f"{split} {value:.3f} (gzip -9: {gzip[split]:.3f})")
            below[split] = value < gzip[split]
    if not parts:
        return None
    if all(below.values()):
        verdict = "below gzip"
    elif any(below.values()):
        verdict = "below gzip on the " + " and ".join(s for s, b in below.items() if b) + " split"
    else:
        verdict = ("not below gzip: train longer (--ckpt_path last --trainer.max_steps N) or "
                   "on a faster machine")
    return f"Bits per byte on the held-out documents: {', '.join(parts)}; {verdict}."
