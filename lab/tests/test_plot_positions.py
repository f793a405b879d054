"""``lab.scripts.plot_positions``: curves by model and context, renamed, skipped, and a
missing file or curve."""

from __future__ import annotations

import pytest

from lab.scripts import plot_positions

HEADER = "model,context_length,start,end,bytes,bits_per_byte\n"


def test_curves_are_read_per_model_and_context_and_plotted(tmp_path):
    (tmp_path / "a.csv").write_text(HEADER + "m,1024,0,512,10,0.9\nm,1024,512,1024,10,0.8\n"
                                    "m,32768,0,512,10,0.7\n")
    (tmp_path / "b.csv").write_text(HEADER + "pilot,32768,0,512,10,0.5\n")
    curves = plot_positions.read_curves([tmp_path / "a.csv", tmp_path / "b.csv"],
                                        {"pilot": "entry"})
    assert curves == {"m @ 1,024": [(0, 512, 0.9), (512, 1024, 0.8)],
                      "m @ 32,768": [(0, 512, 0.7)], "entry @ 32,768": [(0, 512, 0.5)]}
    plot_positions.main([str(tmp_path / "a.csv"), "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no-such.csv: no such file"):
        plot_positions.read_curves([tmp_path / "no-such.csv"])


def test_skipped_curves_are_left_out_and_unknown_ones_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.csv").write_text(HEADER + "m,8192,0,512,10,0.9\nm,32768,0,512,10,0.7\n")
    plotted = {}
    monkeypatch.setattr(plot_positions, "plot_bits_by_position",
                        lambda curves, out, title: plotted.update(curves) or out)
    plot_positions.main([str(tmp_path / "a.csv"), "--out", str(tmp_path / "p.png"),
                         "--skip", "m @ 8,192"])
    assert plotted == {"m @ 32,768": [(0, 512, 0.7)]}
    with pytest.raises(SystemExit):
        plot_positions.main([str(tmp_path / "a.csv"), "--out", str(tmp_path / "p.png"),
                             "--skip", "m @ 1,024"])
    assert "no such curve" in capsys.readouterr().err
