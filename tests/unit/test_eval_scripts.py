"""``longnet eval perplexity|passkey|harness`` end to end on a tiny saved model: files written,
rows as expected."""

from __future__ import annotations

import csv
import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from longnet.cli import main
from longnet.cli.entry import command_parser
from longnet.data import passkey_examples
from longnet.data.subword import from_backend
from longnet.data.tokenizer import train_bpe
from longnet.modeling import LongNetConfig, LongNetLM
from tests.reference import copy_visibility


def script(name: str):
    """``longnet eval <name>`` (``export`` for ``export_pretrained``), called as
    ``script(name).main(argv)``."""
    command = ["export"] if name == "export_pretrained" else ["eval", name.removeprefix("eval_")]
    return types.SimpleNamespace(main=lambda argv: main([*command, *argv]),
                                 parse_args=lambda argv: command_parser().parse_args(
                                     [*command, *argv]))


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(
        hidden_size=32, num_layers=2, num_heads=2, max_positions=32,
        segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), eos_token_id=255,
    ))
    return model.save_pretrained(tmp_path / "tiny")


def test_eval_perplexity_end_to_end(tmp_path: Path, tiny_model: Path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(4):
        text = f"def f{index}(x):\n    return x * {index}\n" * (index + 1)
        (docs / f"d{index}.txt").write_text(text)
    out = tmp_path / "out"
    code = script("eval_perplexity").main([
        "--models", str(tiny_model), str(tiny_model), "--labels", "a", "b",
        "--data-files", str(docs / "*.txt"), "--split", "all",
        "--context-lengths", "16", "64", "--stride", "0.5", "--batch-size", "16",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    rows = read_csv(out / "perplexity.csv")
    assert [(r["model"], r["context_length"]) for r in rows] == [
        ("a", "16"), ("a", "64"), ("b", "16"), ("b", "64")
    ]
    num_bytes = sum(len(p.read_bytes()) for p in docs.iterdir())
    for row in rows:
        assert int(row["bytes"]) == num_bytes and int(row["tokens"]) == num_bytes + 4
        assert float(row["bits_per_byte"]) > 0
    assert rows[0]["bits_per_byte"] == rows[2]["bits_per_byte"]  # same model, same numbers
    assert [r["stride"] for r in rows[:2]] == ["8", "32"]
    baselines = read_csv(out / "compressors.csv")
    assert {(r["compressor"], r["mode"]) for r in baselines} == {
        (c, m) for c in ("gzip", "bzip2", "xz") for m in ("separate", "concatenated")
    }
    assert is_png(out / "perplexity.png")
    info = json.loads((out / "run.json").read_text())
    assert info["context_lengths"] == [16, 64] and len(info["documents"]) == 4
    assert "bits_per_byte" in capsys.readouterr().out


def test_eval_perplexity_by_position_and_same_scored_bytes(tmp_path: Path, tiny_model: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(3):
        (docs / f"d{index}.txt").write_text(f"x = {index}\n" * (20 + 15 * index))
    out = tmp_path / "out"
    code = script("eval_perplexity").main([
        "--models", str(tiny_model), "--data-files", str(docs / "*.txt"), "--split", "all",
        "--context-lengths", "8", "32", "--score-from", "32", "--by-position",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    rows = read_csv(out / "perplexity.csv")
    sizes = [len(p.read_bytes()) for p in sorted(docs.iterdir())]
    for row in rows:  # the same bytes under both context lengths
        assert int(row["scored_bytes"]) == sum(max(0, n - 32) for n in sizes)
    assert rows[0]["scored_bits_per_byte"] != rows[1]["scored_bits_per_byte"]
    positions = read_csv(out / "positions.csv")
    starts = [int(r["start"]) for r in positions if r["context_length"] == "32"]
    assert starts[:2] == [0, 512] or starts == [0]  # buckets of 512 bytes first
    assert sum(int(r["bytes"]) for r in positions if r["context_length"] == "8") == sum(sizes)
    assert is_png(out / "positions.png")


def test_eval_perplexity_score_from_zero_scores_every_byte(tmp_path: Path, tiny_model: Path):
    """``--score-from 0``: all bytes, the closing EOS left out (what lm-eval's bits per byte
    of the same documents measures, see longnet eval harness)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(2):
        (docs / f"d{index}.txt").write_text(f"y = {index}\n" * (9 + 7 * index))
    out = tmp_path / "out"
    assert script("eval_perplexity").main([
        "--models", str(tiny_model), "--data-files", str(docs / "*.txt"), "--split", "all",
        "--context-lengths", "16", "--stride", "1.0", "--score-from", "0",
        "--out", str(out), "--no-progress",
    ]) == 0
    (row,) = read_csv(out / "perplexity.csv")
    assert row["scored_bytes"] == row["bytes"]
    assert float(row["scored_bits_per_byte"]) != float(row["bits_per_byte"])


def test_eval_perplexity_refuses_impossible_lengths(tmp_path: Path, tiny_model: Path, capsys):
    module = script("eval_perplexity")
    with pytest.raises(SystemExit):
        module.parse_args(["--models", "x", "--context-lengths", "0"])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.parse_args(["--models", "x", "--stride", "1.5"])
    assert module.main(["--models", "longnet-nope"]) == 2
    assert "Known models" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["eval_perplexity", "eval_passkey"])
def test_an_unwritable_out_is_refused_before_any_work(tmp_path: Path, name: str, capsys):
    """Checked before the models load (``longnet-nope`` would fail to load): nothing
    computed is lost to an --out that cannot be written."""
    module = script(name)
    existing = tmp_path / "results.csv"
    existing.write_text("earlier results")
    blocked = tmp_path / "out"
    table = blocked / ("perplexity.csv" if name == "eval_perplexity" else "passkey.csv")
    table.mkdir(parents=True)
    for out, message in [
        (existing, f"--out {existing}: {existing} is a file, not a folder; give another --out"),
        (existing / "sub", f"--out {existing / 'sub'}: {existing} is a file, not a folder"),
        (blocked, f"--out {blocked}: {table} is a folder where a file is to be written"),
    ]:
        argv = ["--models", "longnet-nope", "--out", str(out)]
        assert module.main(argv) == 2
        assert message in capsys.readouterr().err
    assert existing.read_text() == "earlier results"


def test_export_refuses_an_output_file_before_reading_the_checkpoint(tmp_path: Path, capsys):
    existing = tmp_path / "model"
    existing.write_text("not a folder")
    module = script("export_pretrained")
    argv = [str(tmp_path / "missing.ckpt"), str(existing)]
    assert module.main(argv) == 2
    assert f"OUTPUT {existing} is a file, not a folder" in capsys.readouterr().err


def test_eval_passkey_end_to_end(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "out"
    code = script("eval_passkey").main([
        "--models", str(tiny_model), "--lengths", "240", "300", "--depths", "0", "1",
        "--num-examples", "2", "--batch-size", "2", "--seed", "5", "--out", str(out),
        "--no-progress",
    ])
    assert code == 0
    rows = read_csv(out / "passkey.csv")
    assert [(r["model"], r["context_length"], r["depth"]) for r in rows] == [
        ("tiny", "240", "0.0"), ("tiny", "240", "1.0"), ("tiny", "300", "0.0"),
        ("tiny", "300", "1.0"),
    ]
    for row in rows:
        assert row["examples"] == "2" and 0 <= float(row["accuracy"]) <= 1
    generations = read_csv(out / "passkey_generations.csv")
    assert len(generations) == 8 and all(len(g["answer"]) == 5 for g in generations)
    examples = passkey_examples(2, 300, 1.0, seed=5)  # the last cell's prompts
    assert [int(g["needle_distance"]) for g in generations[-2:]] == [
        len(e.prompt) - e.prompt.index("The pass key is") for e in examples
    ]
    assert [int(g["copy_distance"]) for g in generations[-2:]] == [
        int(g["needle_distance"]) - len("The pass key is ") - 1 for g in generations[-2:]
    ]
    assert is_png(out / "passkey.png")
    assert json.loads((out / "run.json").read_text())["lengths"] == [240, 300]
    # the tiny model: segments (8, 16, 32), rates (1, 2, 4), 2 heads; each copy's visibility
    # by the pattern's rules (one segment, one offset, a head at it) and the table's counts
    branches = [(8, 1), (16, 2), (32, 4)]
    expected: dict[tuple[str, str], list[int]] = {}
    for g in generations:
        query = int(g["prompt_tokens"]) - 1
        key = query - int(g["copy_distance"])
        assert g["visibility"] == copy_visibility(query, key, branches, 2)
        tally = expected.setdefault((g["context_length"], g["visibility"]), [0, 0])
        tally[0] += 1
        tally[1] += g["correct"] == "True"
    assert {(r["context_length"], r["visibility"]): (r["examples"], r["correct"])
            for r in read_csv(out / "passkey_visibility.csv")} == {
        key: (str(n), str(c)) for key, (n, c) in expected.items()}


def test_eval_passkey_of_a_model_without_a_pattern_writes_no_visibility_table(tmp_path: Path):
    """A config with no dilated pattern (``segment_lengths=None``: dense attention, as an
    imported model) is evaluated like any other; every copy is seen, nothing to split by."""
    torch.manual_seed(0)
    dense = LongNetLM(LongNetConfig(hidden_size=32, num_layers=1, num_heads=2, max_positions=256))
    assert dense.config.segment_lengths is None
    folder = dense.save_pretrained(tmp_path / "dense")
    out = tmp_path / "out"
    code = script("eval_passkey").main([
        "--models", str(folder), "--lengths", "240", "--depths", "0", "--num-examples", "1",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    assert (out / "passkey.csv").exists() and not (out / "passkey_visibility.csv").exists()
    assert {g["visibility"] for g in read_csv(out / "passkey_generations.csv")} == {"dense"}


def test_eval_passkey_refuses_depths_a_length_cannot_tell_apart(tmp_path: Path, tiny_model: Path,
                                                                capsys):
    """238 bytes leave 1 filler byte: depths 0 and 0.5 would put the needle on the same byte
    and be reported as two depths."""
    module = script("eval_passkey")
    argv = ["--models", str(tiny_model), "--lengths", "238", "--depths", "0", "0.5", "1",
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert module.main(argv) == 2
    assert ("--lengths 238: its filler of 1 byte(s) puts the needle of depths 0 and 0.5 on the "
            "same bytes (0 to 0); give longer lengths or fewer depths") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    argv[3] = "256"  # 19 filler bytes: three depths, three places
    assert module.main(argv + ["--num-examples", "2"]) == 0
    means = [float(row["mean_depth"]) for row in read_csv(tmp_path / "out" / "passkey.csv")]
    assert means[0] < 0.25 < means[1] < 0.75 < means[2]


@pytest.fixture
def bpe_model(tmp_path: Path) -> Path:
    """A tiny model of a BPE trained here, saved with its tokenizer files."""
    texts = [f"def f{i}(x):\n    return x * {i}  # é東\n" * 4 for i in range(20)]
    tokenizer = from_backend(train_bpe(texts, 320), "bpe:320")
    torch.manual_seed(0)
    model = LongNetLM(LongNetConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
        max_positions=32, segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4),
        eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
    ))
    folder = model.save_pretrained(tmp_path / "bpe")
    tokenizer.save(folder)
    return folder


def test_eval_scripts_score_a_bpe_model_and_a_byte_model_on_the_same_bytes(
        tmp_path: Path, tiny_model: Path, bpe_model: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(3):
        (docs / f"d{index}.txt").write_text(f"def f{index}(x):\n    return x * 2  # é\n" * 6)
    out = tmp_path / "out"
    code = script("eval_perplexity").main([
        "--models", str(tiny_model), str(bpe_model), "--data-files", str(docs / "*.txt"),
        "--split", "all", "--context-lengths", "32", "--out", str(out), "--no-progress",
        "--by-position",
    ])
    assert code == 0
    byte_row, bpe_row = read_csv(out / "perplexity.csv")
    num_bytes = sum(len(p.read_bytes()) for p in docs.iterdir())
    assert byte_row["bytes"] == bpe_row["bytes"] == str(num_bytes)
    assert int(bpe_row["tokens"]) < int(byte_row["tokens"]) == num_bytes + 3
    assert byte_row["context_bytes"] == "32" and int(bpe_row["context_bytes"]) > 32
    assert float(bpe_row["bytes_per_token"]) > 1.5
    positions = [r for r in read_csv(out / "positions.csv") if r["model"] == "bpe"]
    assert sum(int(r["bytes"]) for r in positions) == num_bytes
    out = tmp_path / "passkey"
    code = script("eval_passkey").main([
        "--models", str(bpe_model), "--lengths", "240", "--depths", "0.5",
        "--num-examples", "2", "--out", str(out), "--no-progress",
    ])
    assert code == 0
    (row,) = read_csv(out / "passkey.csv")
    assert 5 < int(row["context_tokens"]) < 240  # fewer tokens than bytes
    # its copies are counted in its own tokens: segments (8, 16, 32), rates (1, 2, 4), 2 heads
    generations = read_csv(out / "passkey_generations.csv")
    assert all(int(g["copy_distance"]) < int(g["needle_distance"]) - 17 for g in generations)
    kinds = [g["visibility"] for g in generations]
    rows = read_csv(out / "passkey_visibility.csv")
    assert sorted((r["visibility"], r["examples"]) for r in rows) == sorted(
        (kind, str(kinds.count(kind))) for kind in set(kinds))


# ------------------------------------------- progress and results written as they finish
def write_documents(tmp_path: Path) -> str:
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(3):
        (docs / f"d{index}.txt").write_text(f"def g{index}(y):\n    return y - {index}\n" * 4)
    return str(docs / "*.txt")


def fail_from_call(monkeypatch, target: str, calls: int) -> None:
    """Make ``target`` (``module.function``) raise on its call number ``calls + 1``: an
    interrupted run."""
    module, name = target.rsplit(".", 1)
    real, done = getattr(importlib.import_module(module), name), []

    def counted(*args, **kwargs):
        if len(done) == calls:
            raise RuntimeError("interrupted")
        done.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, counted)


def test_an_interrupted_perplexity_run_keeps_the_rows_of_the_lengths_it_finished(
        tmp_path: Path, tiny_model: Path, monkeypatch, capsys):
    fail_from_call(monkeypatch, "longnet.eval.perplexity.score_documents", 1)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        script("eval_perplexity").main([
            "--models", str(tiny_model), "--data-files", write_documents(tmp_path),
            "--split", "all", "--context-lengths", "16", "64", "--by-position",
            "--out", str(out), "--no-progress",
        ])
    rows = read_csv(out / "perplexity.csv")
    assert [(r["model"], r["context_length"]) for r in rows] == [("tiny", "16")]
    assert float(rows[0]["bits_per_byte"]) > 0
    assert {r["context_length"] for r in read_csv(out / "positions.csv")} == {"16"}
    assert not (out / "perplexity.png").exists() and not (out / "run.json").exists()
    assert f"tiny @ 16: {float(rows[0]['bits_per_byte']):.4f} bits per byte" in (
        capsys.readouterr().out)


def test_an_interrupted_passkey_run_keeps_the_cells_of_the_lengths_it_finished(
        tmp_path: Path, tiny_model: Path, monkeypatch):
    fail_from_call(monkeypatch, "longnet.eval.passkey.answer_examples", 2)  # 2 depths a length
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        script("eval_passkey").main([
            "--models", str(tiny_model), "--lengths", "240", "300", "--depths", "0", "1",
            "--num-examples", "2", "--out", str(out), "--no-progress",
        ])
    rows = read_csv(out / "passkey.csv")
    assert [(r["context_length"], r["depth"]) for r in rows] == [("240", "0.0"), ("240", "1.0")]
    assert len(read_csv(out / "passkey_generations.csv")) == 4
    assert {r["context_length"] for r in read_csv(out / "passkey_visibility.csv")} == {"240"}
    assert not (out / "passkey.png").exists() and not (out / "run.json").exists()


def test_progress_bars_per_model_and_length_show_on_stderr_unless_hidden(
        tmp_path: Path, tiny_model: Path, capsys):
    files = write_documents(tmp_path)
    perplexity = ["--models", str(tiny_model), "--data-files", files, "--split", "all",
                  "--context-lengths", "16", "64", "--out", str(tmp_path / "p")]
    passkey = ["--models", str(tiny_model), "--lengths", "240", "300", "--depths", "0", "1",
               "--num-examples", "2", "--out", str(tmp_path / "k")]
    for name, argv in (("eval_perplexity", perplexity), ("eval_passkey", passkey)):
        assert script(name).main(argv) == 0
    err = capsys.readouterr().err
    for bar in ("tiny @ 16: ", "tiny @ 64: ", "passkey tiny @ 240: ", "passkey tiny @ 300: "):
        assert bar in err
    # a passkey length's bar counts its examples, 2 depths x 2 (drawn at 0 when it opens;
    # later draws depend on tqdm's refresh interval)
    assert "passkey tiny @ 240:   0%|          | 0/4 [" in err
    for name, argv in (("eval_perplexity", perplexity), ("eval_passkey", passkey)):
        assert script(name).main([*argv, "--no-progress"]) == 0
    assert "tiny @" not in capsys.readouterr().err


def test_an_interrupted_harness_run_keeps_the_rows_of_the_models_it_finished(
        tmp_path: Path, tiny_model: Path, monkeypatch):
    """lm-eval stood in for (it is an extra): the first model's rows, then an interruption."""
    def evaluate_model(loaded, work_dir, **options):
        if loaded.label == "b":
            raise RuntimeError("interrupted")
        return [{"model": loaded.label, "task": "niah_single_1", "length": 64, "examples": 1,
                 "metric": "string_match_all", "value": 0.0, "seconds": 0.1}]

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # set: the command leaves them
        monkeypatch.setenv(name, "1")
    monkeypatch.setitem(sys.modules, "longnet.hf.harness", types.SimpleNamespace(
        BPB_TASK="longnet_bpb", NIAH_TASKS=("niah_single_1",), evaluate_model=evaluate_model))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        script("eval_harness").main([
            "--models", str(tiny_model), str(tiny_model), "--labels", "a", "b",
            "--tasks", "niah_single_1", "--out", str(out), "--no-progress",
        ])
    assert [(r["model"], r["value"]) for r in read_csv(out / "harness.csv")] == [("a", "0.0")]
    assert not (out / "run.json").exists()
