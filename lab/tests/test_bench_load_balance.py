"""``lab/scripts/bench_load_balance.py`` end to end on a tiny model at two ranks: both layouts run,
the table and the plot are written, and the doc block lands in its section (no timing is
asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():
    path = REPO / "lab" / "scripts" / "bench_load_balance.py"
    spec = importlib.util.spec_from_file_location("bench_load_balance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_layouts_run_and_are_reported(tmp_path, capsys):
    script = _script()
    script.main(["--model", "longnet-tiny", "--seq-len", "1024", "--worlds", "2", "--steps", "1",
                 "--out", str(tmp_path), "--json", str(tmp_path / "samples.json"),
                 "--timeout", "300"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| 2 |")]
    assert [row.split(" | ")[1] for row in rows] == ["contiguous", "zigzag"]
    assert "1.00x" in rows[0]  # the contiguous row is its own baseline
    assert (tmp_path / "bench_load_balance.png").stat().st_size > 0
    doc = (tmp_path / "benchmarks.md").read_text()
    assert "## Sequence-parallel ring" in doc and "### load-balance" in doc
    assert '"layout": "zigzag"' in (tmp_path / "samples.json").read_text()


def test_one_rank_is_refused():
    with pytest.raises(SystemExit):
        _script().parse_args(["--worlds", "1", "2"])
