"""Numbers and paths given to ``longnet eval`` and ``lab/scripts/*.py`` (planning, benchmarks,
the GPU check) are checked when parsed: a negative, zero, NaN or infinite value where it means
nothing, and an empty path, end in one line naming the option and the value, before any
work."""

from __future__ import annotations

from pathlib import Path

import pytest

from longnet.cli.entry import command_parser
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]



MODELS = ["--models", "m"]
PLAN = ["--seq-len", "4096", "--devices", "2"]
TRAINING = ["--model", "longnet-tiny", "--lengths", "64"]
CASES = [
    ("eval_passkey", [*MODELS, "--depths", "0", "nan"], "--depths: expected a finite number "
     "in [0, 1], got 'nan'"),
    ("eval_passkey", [*MODELS, "--depths", "-0.5"], "--depths: expected a finite number in "
     "[0, 1], got '-0.5'"),
    ("eval_passkey", [*MODELS, "--num-digits", "19"], "--num-digits: expected an integer in "
     "[1, 18], got '19'"),
    ("eval_passkey", [*MODELS, "--seed", "-1"], "--seed: expected an integer >= 0, got '-1'"),
    ("eval_passkey", [*MODELS, "--out", ""], "--out: expected a path, got ''"),
    ("eval_perplexity", [*MODELS, "--val-fraction", "nan"], "--val-fraction: expected a finite "
     "number in (0, 1), got 'nan'"),
    ("eval_perplexity", [*MODELS, "--test-fraction", "1.5"], "--test-fraction: expected a "
     "finite number in (0, 1), got '1.5'"),
    ("eval_perplexity", [*MODELS, "--max-documents", "0"], "--max-documents: expected a positive "
     "integer, got '0'"),
    ("eval_perplexity", [*MODELS, "--min-document-bytes", "-1"], "--min-document-bytes: expected "
     "an integer >= 0, got '-1'"),
    ("plan_context", [*PLAN, "--link-gbps", "-1"], "--link-gbps: expected a finite number >= 0, "
     "got '-1'"),
    ("plan_context", [*PLAN, "--link-gbps", "nan"], "--link-gbps: expected a finite number >= 0"),
    ("plan_context", [*PLAN, "--link-gbps", "inf"], "--link-gbps: expected a finite number >= 0"),
    ("plan_context", [*PLAN, "--layers", "0"], "--layers: expected a positive integer, got '0'"),
    ("plan_context", [*PLAN, "--heads", "-2"], "--heads: expected a positive integer, got '-2'"),
    ("plan_context", [*PLAN, "--head-dim", "0"], "--head-dim: expected a positive integer"),
    ("plan_context", [*PLAN, "--batch", "0"], "--batch: expected a positive integer, got '0'"),
    ("plan_context", [*PLAN, "--threads", "0"], "--threads: expected a positive integer"),
    ("plan_context", [*PLAN, "--segments", "", "--rates", "1"], "--segments: expected integers "
     "separated by commas, e.g. 2048,4096, got ''"),
    ("plan_context", [*PLAN, "--model", ""], "--model: expected a path, got ''"),
    ("bench_attention", ["--point-budget", "-1"], "--point-budget: expected a finite number > 0, "
     "got '-1'"),
    ("bench_attention", ["--point-budget", "nan"], "--point-budget: expected a finite number > 0"),
    ("bench_attention", ["--warmup-max-len", "-1"], "--warmup-max-len: cannot read '-1' as a "
     "length"),
    ("bench_attention", ["--sdpa-max-len", "nan"], "--sdpa-max-len: cannot read 'nan' as a"),
    ("bench_attention", ["--check-rows", "0"], "--check-rows: expected a positive integer"),
    ("bench_attention", ["--seed", "-1"], "--seed: expected an integer >= 0, got '-1'"),
    ("bench_attention", ["--json", ""], "--json: expected a path, got ''"),
    ("bench_ring", ["--timeout", "0"], "--timeout: expected a finite number > 0, got '0'"),
    ("bench_ring", ["--timeout", "inf"], "--timeout: expected a finite number > 0, got 'inf'"),
    ("bench_ring", ["--seed", "-3"], "--seed: expected an integer >= 0, got '-3'"),
    ("bench_ring", ["--out", ""], "--out: expected a path, got ''"),
    ("bench_training", [*TRAINING, "--steps", "0"], "--steps: expected a positive integer"),
    ("bench_training", [*TRAINING, "--warmup", "-1"], "--warmup: expected an integer >= 0"),
    ("bench_training", [*TRAINING, "--batch", "nan"], "--batch: expected a positive integer"),
    ("bench_training", [*TRAINING, "--json", " "], "--json: expected a path, got ' '"),
    ("bench_load_balance", ["--timeout", "-1"], "--timeout: expected a finite number > 0"),
    ("bench_load_balance", ["--seed", "-1"], "--seed: expected an integer >= 0"),
]


@pytest.mark.parametrize("name, argv, message", CASES, ids=lambda value: str(value)[:40])
def test_bad_numbers_and_paths_are_refused_when_parsed(name, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        if name.startswith("eval_"):  # longnet eval passkey|perplexity
            command_parser().parse_args(["eval", name.removeprefix("eval_"), *argv])
        else:
            load_script(name).parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


def test_the_planner_plans_a_link_speed_of_zero_as_no_link(capsys):
    plan_context = load_script("plan_context")
    assert plan_context.main([*PLAN, "--link-gbps", "0"]) == 0
    assert "Gbit/s" not in capsys.readouterr().out
    assert plan_context.main([*PLAN, "--link-gbps", "100"]) == 0
    assert "at 100 Gbit/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--only", "cuda-tests"], "--only cuda-tests: no such step; the steps: environment, "
     "cuda tests,"),
    (["--out", ""], "--out: expected a path, got ''"),
    (["--wheels", "no-such-folder"], "--wheels no-such-folder: no such folder"),
])
def test_gpu_check_refuses_bad_arguments_before_looking_for_a_gpu(argv, message, capsys):
    assert load_script("gpu_check").main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


def test_gpu_check_refuses_an_output_file_before_looking_for_a_gpu(tmp_path, capsys):
    existing = tmp_path / "report"
    existing.write_text("earlier")
    assert load_script("gpu_check").main(["--out", str(existing)]) == 2
    assert f"--out {existing}: {existing} is a file, not a folder" in capsys.readouterr().err
    assert existing.read_text() == "earlier"
