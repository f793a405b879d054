"""``read_curves`` and ``plot_training_curves``: the training-curve PNG of a run folder."""

from __future__ import annotations

import pytest

from longnet.training import plot_training_curves, read_curves


def write_csv(path, rows):
    header = ["epoch", "step", "train/bpb", "val/bpb"]
    lines = [",".join(header)] + [",".join(str(row.get(k, "")) for k in header) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def test_read_curves_sorts_skips_and_keeps_the_later_duplicate(tmp_path):
    metrics = tmp_path / "metrics.csv"
    write_csv(metrics, [
        {"step": 20, "train/bpb": 3.0},
        {"step": 10, "train/bpb": 4.0},
        {"step": 20, "val/bpb": 2.5},
        {"epoch": 0},                       # no step: skipped
        {"step": 20, "train/bpb": 2.9},     # resumed run repeats step 20: the later row wins
    ])
    curves = read_curves(metrics)
    assert curves == {"train/bpb": [(10, 4.0), (20, 2.9)], "val/bpb": [(20, 2.5)]}


def test_plot_training_curves_writes_a_png(tmp_path):
    path = plot_training_curves(
        {"train/bpb": [(10, 4.0), (20, float("nan")), (30, 3.0)], "val/bpb": []},
        tmp_path / "sub" / "curves.png",
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_curves_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_curves(tmp_path / "metrics.csv")
