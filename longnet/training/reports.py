"""What a run reports: progress in optimizer steps (a resumed run reads "step 300/400"),
``metrics.json``, predictions, ``curves.png`` and every rank's peak memory (``memory.json``:
CUDA allocator peak or CPU ``VmHWM``, above the start)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from longnet.files import write_atomic
from longnet.training.parallel.strategy import SequenceParallelLayout
from longnet.training.run_folder import RUN_ID_COLUMN, run_dir
from longnet.validation import check_positive_int

CURVE_KEYS = ("train/bpb", "val/bpb")
SMOOTHING_FRACTION = 0.05
"""Training curves get a trailing mean over this fraction of their logged points."""
MIB = 2**20
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def total_steps(trainer: L.Trainer) -> float:
    """The optimizer steps the run will reach (``inf`` when unbounded)."""
    return float(trainer.estimated_stepping_batches)


def _without_version(metrics: dict[str, Any]) -> dict[str, Any]:
    metrics.pop("v_num", None)  # RunLogger has no version sub-folder
    return metrics


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, its training bar counting optimizer steps (also after a resume)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)  # a resume inside an epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._count_steps(trainer)

    def _count_steps(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        total = total_steps(trainer)
        bar.reset(None if math.isinf(total) else int(total))
        bar.initial = bar.n = trainer.global_step  # the rate counts this run's steps only
        bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is None or bar.disable or bar.n == step:
            return
        total = total_steps(trainer)
        if math.isfinite(total) and bar.total != int(total):  # re-planned (TimeBudget)
            bar.total = int(total)
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes


class LineProgressBar(ProgressBar):
    """Progress as plain lines for logs and pipes, and one line per validation.

    Args:
        lines: how many progress lines a whole run prints (at most one per step).
    """

    def __init__(self, lines: int = 20) -> None:
        super().__init__()
        self.lines = lines
        self._enabled = True
        self._started = 0.0
        self._first_step = 0
        self._last_printed = -1

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started, self._first_step = time.monotonic(), trainer.global_step
        self._last_printed = trainer.global_step
        if self.is_enabled:
            total = total_steps(trainer)
            of = "" if math.isinf(total) else f" of {int(total)}"
            self.print(f"Training from step {trainer.global_step}{of}.", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step, total = trainer.global_step, total_steps(trainer)
        every = max(1, int(total) // self.lines) if math.isfinite(total) else 100
        if not self.is_enabled or step == self._last_printed:
            return
        if step % every == 0 or step == total:
            self._last_printed = step
            self.print(self._line(trainer, pl_module, step, total), flush=True)

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int,
              total: float) -> str:
        elapsed = time.monotonic() - self._started
        rate = (step - self._first_step) / elapsed if elapsed > 0 else 0.0
        parts = [f"step {step}" + ("" if math.isinf(total) else
                                   f"/{int(total)} ({100 * step / max(total, 1):.0f}%)")]
        metrics = _without_version(self.get_metrics(trainer, pl_module))
        parts += [f"{key} {_short(value)}" for key, value in metrics.items()]
        parts.append(f"{rate:.2f} steps/s")
        if rate > 0 and math.isfinite(total):
            parts.append(f"{_clock(elapsed)} elapsed, {_clock((total - step) / rate)} left")
        return "  ".join(parts)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.is_enabled or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        values = {key: value for key, value in trainer.callback_metrics.items()
                  if key.startswith("val/")}
        shown = "  ".join(f"{key} {_short(float(value))}" for key, value in values.items())
        self.print(f"validation at step {trainer.global_step}: {shown}", flush=True)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def progress_bar() -> ProgressBar:
    """:class:`StepProgressBar` when stdout is a terminal, else :class:`LineProgressBar`."""
    return StepProgressBar() if sys.stdout.isatty() else LineProgressBar()


class MetricsSummary(L.Callback):
    """Write the last validation and test metrics to ``<run folder>/metrics.json``:
    ``{"validate": {...}, "test": {...}}``, each with ``step`` and ``run_id``."""

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
        write_atomic(path, json.dumps(data, indent=2) + "\n")


class PredictionsWriter(BasePredictionWriter):
    """Write ``predict`` outputs to ``<dirpath>/predictions-<data-parallel rank>.jsonl``.

    Args:
        dirpath: destination folder; None is the run folder.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self._folder: Path | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # on every rank: log_dir is a collective (ranks may get different predict batch counts)
        self._folder = Path(self.dirpath) if self.dirpath else run_dir(trainer)
        path = self._path(trainer)
        if stage == "predict" and path is not None:
            path.unlink(missing_ok=True)  # a new predict replaces the file, never extends it

    def _path(self, trainer: L.Trainer) -> Path | None:
        """This rank's file; None where its sequence-parallel group's rank 0 writes it."""
        folder = self._folder or Path(self.dirpath or trainer.default_root_dir)
        strategy, rank = trainer.strategy, trainer.global_rank
        if isinstance(strategy, SequenceParallelLayout):
            if strategy.sequence_parallel_rank != 0:
                return None
            rank = strategy.data_parallel_rank
        return folder / f"predictions-{rank}.jsonl"

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                           batch_idx, dataloader_idx) -> None:
        path = self._path(trainer)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = {key: value.tolist() for key, value in prediction.items()}
        indices = list(batch_indices) if batch_indices is not None else [None] * len(
            next(iter(columns.values())))
        with open(path, "a") as handle:
            for row, index in enumerate(indices):
                record = {"index": index, **{key: column[row] for key, column in columns.items()}}
                handle.write(json.dumps(record) + "\n")


def read_curves(
    metrics_csv: str | Path, keys: Sequence[str] = CURVE_KEYS, run_id: str | None = None
) -> dict[str, list[tuple[int, float]]]:
    """``key -> [(step, value), ...]`` (sorted; a repeated step keeps the later row) from a
    Lightning CSV log, only ``run_id``'s rows (and rows without one) when given."""
    values: dict[str, dict[int, float]] = {key: {} for key in keys}
    with open(metrics_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            other_run = run_id and row.get(RUN_ID_COLUMN) not in (run_id, "", None)
            if not row.get("step") or other_run:
                continue
            step = int(float(row["step"]))
            for key in keys:
                if row.get(key):
                    values[key][step] = float(row[key])
    return {key: sorted(points.items()) for key, points in values.items()}


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """At every position, the mean of the last ``window`` (> 0) values up to it."""
    check_positive_int("window", window)
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        means.append(total / min(i + 1, window))
    return means


def plot_training_curves(
    curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, *, title: str = ""
) -> Path:
    """Plot each curve (bits per byte) against the optimizer step to the PNG ``path``
    (atomically; returned); training curves faint, with their trailing mean on top."""
    fig = Figure(figsize=(7.0, 4.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, points in curves.items():
        points = [(step, value) for step, value in points if math.isfinite(value)]
        if not points:
            continue
        steps, values = zip(*points)
        if key.startswith("val"):
            ax.plot(steps, values, marker="o", linewidth=1.2, label=key)
            continue
        window = max(1, round(SMOOTHING_FRACTION * len(values)))
        raw = ax.plot(steps, values, linewidth=0.8, alpha=0.35, label=key)[0]
        if window > 1:
            ax.plot(steps, trailing_mean(values, window), color=raw.get_color(), linewidth=1.6,
                    label=f"{key}, mean of last {window} points")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits per byte")
    ax.set_title(title or "Training curves")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    image = io.BytesIO()
    fig.savefig(image, format="png")
    return write_atomic(path, image.getvalue())


class TrainingCurves(L.Callback):
    """When ``fit`` ends, plot this run's ``train/bpb`` and ``val/bpb`` to the run folder.

    Args:
        filename: the PNG's name inside the run folder.
    """

    def __init__(self, filename: str = "curves.png") -> None:
        self.filename = filename

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = run_dir(trainer)  # on every rank: log_dir is a collective
        if not trainer.is_global_zero or trainer.logger is None:
            return
        trainer.logger.save()  # flush buffered rows to metrics.csv
        metrics = folder / "metrics.csv"
        if not metrics.is_file():
            return
        curves = read_curves(metrics, run_id=getattr(trainer.logger, "run_id", None))
        title = f"Training curves: {folder.name}"
        plot_training_curves(curves, folder / self.filename, title=title)


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``: now, ``VmHWM``: peak) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class PeakMemory(L.Callback):
    """Write every rank's peak memory during ``fit`` (start, peak and peak above start, MiB)
    to ``<run folder>/memory.json``; collective at train end."""

    def __init__(self, filename: str = "memory.json") -> None:
        self.filename = filename
        self._start = 0
        self._peak_since = "train start"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._start = torch.cuda.memory_allocated(pl_module.device)
        else:
            self._start = status_bytes("VmRSS")
            if not reset_peak_rss():
                self._peak_since = "process start"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        peak = (
            torch.cuda.max_memory_allocated(device)
            if device.type == "cuda"
            else status_bytes("VmHWM")
        )
        mine = torch.tensor([self._start, peak], dtype=torch.float64, device=device)
        ranks = trainer.strategy.all_gather(mine).reshape(-1, 2).tolist()
        path = run_dir(trainer) / self.filename  # on every rank: log_dir is a collective
        if not trainer.is_global_zero:
            return
        report = {
            "device": device.type,
            "step": trainer.global_step,
            "peak_since": self._peak_since,
            "malloc_mmap_threshold": os.environ.get(MMAP_THRESHOLD),
            "ranks": [
                {
                    "rank": rank,
                    "start_mib": round(start / MIB, 2),
                    "peak_mib": round(peak / MIB, 2),
                    "peak_above_start_mib": round((peak - start) / MIB, 2),
                }
                for rank, (start, peak) in enumerate(ranks)
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
