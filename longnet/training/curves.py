"""``TrainingCurves``: the run's bits-per-byte curves as a PNG next to its ``metrics.csv``."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning as L
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from longnet.files import write_atomic
from longnet.training.callbacks import run_dir
from longnet.training.logger import RUN_ID_COLUMN
from longnet.validation import check_positive_int

CURVE_KEYS = ("train/bpb", "val/bpb")
SMOOTHING_FRACTION = 0.05
"""Training curves get a trailing mean over this fraction of their logged points."""


def read_curves(
    metrics_csv: str | Path, keys: Sequence[str] = CURVE_KEYS, run_id: str | None = None
) -> dict[str, list[tuple[int, float]]]:
    """``key -> [(step, value), ...]`` (sorted by step) from a Lightning CSV log.

    Rows without the key or a step are skipped; a step logged twice (a resumed run repeats
    the steps after its last checkpoint) keeps the later row. With ``run_id``, only the rows
    of that run are read (and rows without a ``run_id``: logs written without run ids).
    """
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
    """At every position, the mean of the last ``window`` values up to it (fewer at the
    start). ``window`` must be positive."""
    check_positive_int("window", window)
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        means.append(total / min(i + 1, window))
    return means


def plot_training_curves(
    curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path, *, title: str = ""
) -> Path:
    """Line plot of each curve (bits per byte) against the optimizer step; empty curves are
    left out. A training curve (one batch per point, noisy) is drawn faint with its trailing
    mean over ``SMOOTHING_FRACTION`` of its points on top. The PNG replaces ``path`` whole
    (:func:`longnet.files.write_atomic`). Returns ``path``."""
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
    """When ``fit`` ends, plot ``train/bpb`` and ``val/bpb`` of this run (the rows with the
    logger's ``run_id``, when it has one) from the run folder's ``metrics.csv`` (written by
    ``RunLogger``) to ``<run folder>/<filename>``.

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
