"""Where the benchmark scripts write: every output is checked before anything is measured (a
run is not lost to an ``--out`` or ``--json`` that cannot be written), by default into
``runs/<script>/`` (printed), and into the repository's ``docs/`` only with ``--update-docs``
(a benchmark run from a checkout changes no tracked file unless asked to)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest

from lab.bench import common
from longnet.modeling import LongNetConfig, LongNetLM
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
TINY = LongNetConfig(hidden_size=32, num_layers=2, num_heads=2, max_positions=32,
                     segment_lengths=(8, 16), dilation_rates=(1, 2))



# the function each script measures with (replaced: reaching it is the failure) and its argv
WORK = {
    "bench_attention": ("measure_length", ["--lengths", "64", "--no-memory"]),
    "bench_ring": ("run_cases", ["--seq-len", "64", "--base-segment", "16", "--worlds", "1"]),
    "bench_training": ("time_length", ["--model", "longnet-tiny", "--lengths", "64"]),
    "bench_load_balance": ("run_workers", ["--seq-len", "64", "--worlds", "2"]),
}


def _no_work(*_, **__):
    raise AssertionError("measured before checking the outputs")


@pytest.mark.parametrize("name", sorted(WORK))
def test_unwritable_outputs_are_refused_before_any_measurement(name, tmp_path, monkeypatch,
                                                               capsys):
    module = load_script(name)
    function, argv = WORK[name]
    monkeypatch.setattr(module, function, _no_work)
    existing = tmp_path / "notes.txt"
    existing.write_text("earlier")
    folder = tmp_path / "samples"
    folder.mkdir()
    for extra, message in [
        (["--out", str(existing)], f"--out {existing}: {existing} is a file, not a folder"),
        (["--out", str(tmp_path / "out"), "--json", str(folder)],
         f"--json {folder} is a folder; give the path of a file"),
        (["--out", str(tmp_path / "out"), "--json", str(existing / "samples.json")],
         f"--json {existing}: {existing} is a file, not a folder"),
        (["--update-docs", "--out", str(tmp_path / "out")],
         "--update-docs writes into the repository's docs/ folder; --out names another"),
    ]:
        assert module.run_cli(functools.partial(module.main, [*argv, *extra])) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert existing.read_text() == "earlier"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_bench_writes_under_runs_by_default_and_docs_only_when_asked(
        tmp_path, monkeypatch, capsys):
    module = load_script("bench_training")
    folder = LongNetLM(TINY).save_pretrained(tmp_path / "tiny")
    argv = ["--model", str(folder), "--lengths", "16", "--steps", "1", "--warmup", "0"]
    docs = REPO / "docs" / "benchmarks.md"
    before = _digest(docs)
    monkeypatch.chdir(tmp_path)
    assert module.main(argv) == 0
    out = tmp_path / "runs" / "bench_training"
    assert "## Training step" in (out / "benchmarks.md").read_text()
    assert (out / "bench_training.png").is_file()
    printed = capsys.readouterr().out
    written = "runs/bench_training/bench_training.png, runs/bench_training/benchmarks.md"
    assert f"wrote {written}" in printed
    assert _digest(docs) == before
    fake_docs = tmp_path / "docs"
    fake_docs.mkdir()
    (fake_docs / "benchmarks.md").write_text("# Benchmarks\n\nkept\n")
    monkeypatch.setattr(common, "DOCS", fake_docs)
    assert module.main([*argv, "--update-docs"]) == 0
    text = (fake_docs / "benchmarks.md").read_text()
    assert "kept" in text and "## Training step" in text
    assert (fake_docs / "bench_training.png").is_file()
    assert _digest(docs) == before


def test_update_docs_needs_the_repository_docs(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DOCS", tmp_path / "site-packages" / "docs")
    module = load_script("bench_ring")
    monkeypatch.setattr(module, "run_cases", _no_work)
    with pytest.raises(ValueError, match="docs/benchmarks.md.*not a checkout.*--out"):
        module.main(["--seq-len", "64", "--base-segment", "16", "--worlds", "1",
                     "--update-docs"])


@pytest.mark.parametrize("name", sorted(WORK))
def test_every_bench_script_defaults_to_a_runs_folder(name, monkeypatch, tmp_path):
    module = load_script(name)
    function, argv = WORK[name]
    monkeypatch.setattr(module, function, _no_work)
    monkeypatch.chdir(tmp_path)
    args = module.parse_args(argv)
    common.check_outputs(args, name, [])
    assert args.out == Path("runs") / name


def test_attention_bench_writes_its_plot_samples_and_block_to_out(tmp_path, capsys):
    module = load_script("bench_attention")
    out, samples = tmp_path / "out", tmp_path / "samples.json"
    argv = ["--lengths", "64", "--pattern", "16,32/1,2", "--heads", "1", "--head-dim", "8",
            "--repeats", "1", "--no-memory", "--systems", "ours", "--tag", "tiny",
            "--out", str(out), "--json", str(samples)]
    assert module.main(argv) == 0
    assert (out / "bench_attention_tiny.png").is_file()
    assert '"points"' in samples.read_text()
    assert "<!-- bench_attention:tiny:begin -->" in (out / "benchmarks.md").read_text()
    printed = capsys.readouterr().out
    assert f"samples: {samples}" in printed and f"updated {out / 'benchmarks.md'}" in printed
