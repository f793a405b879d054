"""Figures of the evaluations (matplotlib on an Agg canvas: no global backend, no display)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_BASELINE_STYLES = {"gzip": ":", "bzip2": "--", "xz": "-."}


def plot_bits_per_byte(
    curves: Mapping[str, Sequence[tuple[int, float]]],
    baselines: Mapping[str, float],
    path: str | Path,
    *,
    title: str = "Bits per byte vs context length",
    baseline_note: str = "",
    training_lengths: Mapping[str, int] | None = None,
) -> Path:
    """Bits per byte against context length (log2 axis), a line per model and a horizontal
    line per compressor.

    Args:
        curves: model label -> ``[(context_length, bits_per_byte), ...]``.
        baselines: compressor name -> bits per byte.
        path: the PNG to write.
        baseline_note: appended to the compressor legend entries.
        training_lengths: model label -> training length, a dotted vertical line.
    """
    fig = Figure(figsize=(7.5, 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, points in curves.items():
        points = sorted(points)
        (line,) = ax.plot([c for c, _ in points], [b for _, b in points], marker="o",
                          label=label)
        if training_lengths and label in training_lengths:
            ax.axvline(training_lengths[label], color=line.get_color(), linewidth=0.8,
                       alpha=0.5, linestyle=":")
    for index, (name, value) in enumerate(baselines.items()):
        ax.axhline(
            value,
            color="0.35",
            linestyle=_BASELINE_STYLES.get(name, (0, (index + 1, 2))),
            linewidth=1.2,
            label=f"{name}{baseline_note} ({value:.3f})",
        )
    lengths = sorted({c for points in curves.values() for c, _ in points})
    if lengths:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_short(c) for c in lengths])
    return _save_bits_plot(fig, ax, "context length (tokens = bytes)", title, path)


def plot_bits_by_position(
    curves: Mapping[str, Sequence[tuple[int, int, float]]],
    path: str | Path,
    *,
    title: str = "Bits per byte by position in the document",
) -> Path:
    """Bits per byte against position bucket, a line per curve.

    Args:
        curves: label -> ``[(start, end, bits_per_byte), ...]``; NaN buckets are skipped.
        path: the PNG to write.
    """
    if not curves:
        raise ValueError("no position buckets to plot.")
    buckets = sorted({(start, end) for points in curves.values() for start, end, _ in points})
    index = {bucket: i for i, bucket in enumerate(buckets)}
    fig = Figure(figsize=(max(7.5, 0.8 * len(buckets) + 2), 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, points in curves.items():
        kept = sorted((index[(s, e)], b) for s, e, b in points if not math.isnan(b))
        ax.plot([i for i, _ in kept], [b for _, b in kept], marker="o", label=label)
    ax.set_xticks(range(len(buckets)), [f"{_short(s)}-{_short(e)}" for s, e in buckets],
                  rotation=30, ha="right")
    return _save_bits_plot(fig, ax, "position of the scored byte in its document (bytes)",
                           title, path)


def plot_passkey_heatmaps(
    grids: Mapping[str, tuple[Sequence[int], Sequence[float], np.ndarray]],
    path: str | Path,
    *,
    title: str = "Passkey retrieval accuracy",
) -> Path:
    """A depth-by-length accuracy heatmap per model, side by side.

    Args:
        grids: model label -> ``(lengths, depths, accuracy)`` with ``accuracy`` of shape
            ``(len(depths), len(lengths))`` in ``[0, 1]``.
        path: the PNG to write.
    """
    if not grids:
        raise ValueError("no passkey results to plot.")
    count = len(grids)
    first_lengths, first_depths, _ = next(iter(grids.values()))
    width = max(4.0, 0.9 * len(first_lengths) + 2.0)
    height = max(3.0, 0.5 * len(first_depths) + 1.8)
    fig = Figure(figsize=(width * count + 1.0, height + 0.6), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, count, squeeze=False)[0]
    image = None
    for ax, (label, (lengths, depths, accuracy)) in zip(axes, grids.items()):
        accuracy = np.asarray(accuracy, dtype=float)
        if accuracy.shape != (len(depths), len(lengths)):
            raise ValueError(
                f"{label}: accuracy has shape {accuracy.shape}, expected "
                f"(depths, lengths) = ({len(depths)}, {len(lengths)})."
            )
        image = ax.imshow(accuracy, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for row in range(len(depths)):
            for col in range(len(lengths)):
                value = accuracy[row, col]
                text = "n/a" if math.isnan(value) else f"{value:.2f}"
                ax.text(col, row, text, ha="center", va="center", fontsize="small")
        ax.set_xticks(range(len(lengths)), [_short(c) for c in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (bytes)")
        ax.set_ylabel("needle depth")
        ax.set_title(label)
    fig.colorbar(image, ax=list(axes), label="accuracy", fraction=0.05)
    fig.suptitle(title)
    return _save(fig, path)


def _short(length: int) -> str:
    """1024 -> '1K', 1536 -> '1536', 1048576 -> '1M'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if length >= size and length % size == 0:
            return f"{length // size}{unit}"
    return str(length)


def _save_bits_plot(fig: Figure, ax, xlabel: str, title: str, path: str | Path) -> Path:
    """Label a bits-per-byte line plot and write it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bits per byte")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
