"""``RunLogger``: CSV metrics in one fixed run folder that survive resumes and later runs."""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


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

    Args:
        save_dir: parent folder of runs.
        name: the run's folder name.
        flush_logs_every_n_steps: how often rows are written to disk.
    """

    def __init__(self, save_dir: str = "runs", name: str = "run",
                 flush_logs_every_n_steps: int = 50) -> None:
        if not name:
            raise ValueError("name must be a non-empty folder name for the run.")
        super().__init__(save_dir=save_dir, name=name, version="",
                         flush_logs_every_n_steps=flush_logs_every_n_steps)

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
