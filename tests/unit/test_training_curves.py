"""``read_curves``, ``trailing_mean`` and ``plot_training_curves``: the training-curve PNG of a
run folder."""

from __future__ import annotations

import pytest

from longnet.training import plot_training_curves, read_curves
from longnet.training.reports import trailing_mean


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


def test_trailing_mean_averages_the_last_window_values():
    assert trailing_mean([4.0, 2.0, 6.0, 0.0, 1.0], 3) == [4.0, 3.0, 4.0, 8 / 3, 7 / 3]
    assert trailing_mean([1.0, 5.0], 1) == [1.0, 5.0]
    with pytest.raises(ValueError, match="window"):
        trailing_mean([1.0], 0)


def test_plot_training_curves_draws_the_smoothed_training_curve(tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = []
    savefig = matplotlib.figure.Figure.savefig

    def capture(fig, *args, **kwargs):
        drawn.extend(line.get_label() for line in fig.axes[0].get_lines())
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    plot_training_curves({"train/bpb": [(s, 5.0 - s / 100) for s in range(100)]},
                         tmp_path / "curves.png")
    assert drawn == ["train/bpb", "train/bpb, mean of last 5 points"]


def test_read_curves_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_curves(tmp_path / "metrics.csv")
