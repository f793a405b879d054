"""``RunLogger``: CSV metrics in one fixed run folder that survive resumes and later runs,
every row tagged with the id of the run that wrote it."""

from __future__ import annotations

import csv
from collections.abc import Mapping

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

RUN_ID_COLUMN = "run_id"


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued (its header
    kept, rows appended) instead of deleted."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = list(next(csv.reader(handle), []))


class RunLogger(CSVLogger):
    """Log to ``<save_dir>/<name>/metrics.csv`` (+ ``hparams.yaml``); that folder is the run
    folder (``trainer.log_dir``) where checkpoints, the saved config and exports also go.

    Unlike ``CSVLogger`` there is no ``version_N`` sub-folder, so re-running a command (e.g.
    ``fit --ckpt_path last`` after an interruption, or ``test`` later) finds the same folder,
    and ``metrics.csv`` is appended to, not replaced. Steps between the last checkpoint and an
    interruption may appear twice; the later rows are the resumed run's.

    Every row carries the ``run_id`` column: the id the ``longnet`` command gives each run
    (``longnet.training.runs.RunId`` sets :attr:`run_id`; a resumed run keeps its id), so rows
    of different commands in one folder (a ``fit``, a later ``test``) stay apart.

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
