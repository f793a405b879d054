"""One run per run folder (:func:`run_dir`): a lock while a command works in it
(:class:`RunLock`), a run id on its outputs (:class:`RunId`) and its CSV log
(:class:`RunLogger`); a new ``fit`` refuses another run's outputs (:func:`earlier_run_outputs`).
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from longnet.validation import UsageError

LOCK_NAME = "run.lock"
RUN_ID_KEY = "longnet_run_id"
"""Top-level key of the run id in the checkpoints :class:`RunId` tags."""
EXPORT_NAME = "model"
RUN_ID_COLUMN = "run_id"
"""The ``metrics.csv`` column of the run id (:class:`RunLogger`)."""


def new_run_id() -> str:
    """A fresh run id: the start time and 6 random hex digits, e.g. ``20260101-120000-3fa2c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def checkpoint_run_id(checkpoint: Mapping[str, Any]) -> str | None:
    """The run id a checkpoint is tagged with (None for a checkpoint without one)."""
    run_id = checkpoint.get(RUN_ID_KEY)
    return run_id if isinstance(run_id, str) else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class RunLock:
    """``<folder>/run.lock`` while a command works in ``folder``.

    Args:
        folder: the run folder (created if missing).
        run_id: the id written into the lock (and named when another command is refused).
    """

    def __init__(self, folder: str | Path, run_id: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.run_id = run_id
        self.held = False

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def _holder(self) -> dict[str, Any] | None:
        """The lock's record; None if it vanished or cannot be read (a damaged lock)."""
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def acquire(self) -> None:
        """Take the lock, or raise :class:`UsageError` naming the live command that holds it
        (a dead process's lock on this host is taken over; another host's is refused)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = self.folder / f".{LOCK_NAME}.{os.getpid()}.{secrets.token_hex(3)}"
        staging.write_text(json.dumps(self._record()) + "\n")
        try:
            while True:
                try:
                    os.link(staging, self.path)  # atomic: fails if the lock exists
                    self.held = True
                    return
                except FileExistsError:
                    holder = self._holder()
                    if holder is None:
                        continue  # released meanwhile: try again
                    self._refuse_or_take_over(holder)
        finally:
            staging.unlink()

    def _refuse_or_take_over(self, holder: dict[str, Any]) -> None:
        pid, host = holder.get("pid"), holder.get("host")
        same_host = host == socket.gethostname()
        if isinstance(pid, int) and same_host and pid != os.getpid() and _process_alive(pid):
            raise UsageError(
                f"run folder {self.folder} is in use by run {holder.get('run_id')} (pid {pid}, "
                f"started {holder.get('started')}). Wait for it to end, or give this run its "
                "own folder: --trainer.logger.init_args.name <new name>."
            )
        if isinstance(pid, int) and host and not same_host:
            raise UsageError(
                f"run folder {self.folder} is in use by run {holder.get('run_id')} (pid {pid} "
                f"on host {host}, which this machine cannot check). Give this run its own "
                f"folder (--trainer.logger.init_args.name <new name>), or delete {self.path} "
                "if that run is no longer running."
            )
        what = (f"run {holder.get('run_id')} (pid {pid}, no longer running)" if pid
                else "a damaged lock")
        warnings.warn(f"{self.path}: taking over the lock of {what}.", stacklevel=3)
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if this object holds it (and it still names this run)."""
        if self.held and (self._holder() or {}).get("run_id") == self.run_id:
            self.path.unlink(missing_ok=True)
        self.held = False


def earlier_run_outputs(folder: str | Path, checkpoint_dirs: list[Path]) -> list[str]:
    """An earlier run's checkpoints (in ``checkpoint_dirs``) and ``model/`` export."""
    folder = Path(folder)
    found = [path for directory in checkpoint_dirs for path in sorted(directory.glob("*.ckpt"))]
    if (folder / EXPORT_NAME).is_dir():
        found.append(folder / EXPORT_NAME)
    return [str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)
            for path in found]


class RunId(L.Callback):
    """Tag a run's outputs with its id: ``RunLogger`` rows, ``metrics.json`` and every
    checkpoint (:data:`RUN_ID_KEY`).

    Args:
        run_id: the id; a resumed run passes the id of the checkpoint it resumes.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            if hasattr(logger, "run_id"):
                logger.run_id = self.run_id

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_ID_KEY] = self.run_id


def run_dir(trainer: L.Trainer) -> Path:
    """The run folder: the logger's ``log_dir`` (else ``trainer.default_root_dir``). A
    collective: call it on EVERY rank (a rank-zero-only call deadlocks)."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def run_folder(trainer: L.Trainer) -> Path:
    """The run folder as ``trainer.log_dir`` finds it, without the collective."""
    logger = trainer.logger
    if logger is None:
        return Path(trainer.default_root_dir)
    return Path(getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir)


def checkpoint_dirs(trainer: L.Trainer, *, save_last: bool = False) -> list[Path]:
    """The folders the trainer's ``ModelCheckpoint``\\ s (``save_last`` ones) write to."""
    folders = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or (save_last and not callback.save_last):
            continue
        if callback.dirpath:
            folders.append(Path(callback.dirpath))
        elif trainer.logger is not None:
            logger = trainer.logger
            version = logger.version if isinstance(logger.version, str) else \
                f"version_{logger.version}"
            save_dir = logger.save_dir or trainer.default_root_dir
            folders.append(Path(save_dir, str(logger.name), version, "checkpoints"))
        else:
            folders.append(Path(trainer.default_root_dir, "checkpoints"))
    return list(dict.fromkeys(folders))


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, continuing an existing ``metrics.csv`` instead of deleting it."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = list(next(csv.reader(handle), []))


class RunLogger(CSVLogger):
    """Log to ``<save_dir>/<name>/metrics.csv``, the run folder: unlike ``CSVLogger`` no
    ``version_N`` sub-folder, rows appended across runs (redone steps twice, the later the
    resume's), each with a ``run_id`` column (:class:`RunId`).

    Args:
        save_dir: parent folder of runs (not empty).
        name: the run's folder name.
        flush_logs_every_n_steps: how often rows are written to disk.
    """

    def __init__(self, save_dir: str = "runs", name: str = "run",
                 flush_logs_every_n_steps: int = 50) -> None:
        if not name:
            raise ValueError("name must be a non-empty folder name for the run.")
        if not save_dir:
            raise ValueError("save_dir is empty; give the folder of runs (e.g. runs): an empty "
                             "one would put the run folder in the current folder.")
        super().__init__(save_dir=save_dir, name=name, version="",
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self.run_id: str | None = None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Tensor | float], step: int | None = None) -> None:
        if self.run_id is not None:
            metrics = {**metrics, RUN_ID_COLUMN: self.run_id}
        super().log_metrics(dict(metrics), step)

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
