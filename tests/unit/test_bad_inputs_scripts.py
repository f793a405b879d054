"""Bad arguments of ``longnet eval`` and the lab scripts end in one line naming the option,
the value and the fix, before any work (the ``script-`` cases of
``lab/bad_inputs/scripts.yaml``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from lab.bench.attention import pattern_argument
from lab.memory.state import model_config
from longnet.cli import main
from longnet.cli.arguments import device_argument
from longnet.cli.entry import command_parser
from longnet.eval.documents import load_eval_documents
from longnet.eval.passkey import check_passkey_grid
from longnet.eval.reporting import write_csv
from longnet.validation import UsageError
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]



def refused(parse, argv: list[str], capsys) -> str:
    """What ``parse(argv)`` printed when it refused ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_an_argument_error_is_one_line_without_the_usage(capsys):
    argv = ["eval", "perplexity", "--models", "m", "--context-lengths", "0"]
    err = refused(command_parser().parse_args, argv, capsys)
    assert err.splitlines() == [
        "error: argument --context-lengths: lengths must be at least 1, got '0'; "
        "see longnet eval perplexity --help."
    ]
    assert main(argv) == 2 and capsys.readouterr().err == err


@pytest.mark.parametrize("text, message", [
    ("gpu", "'gpu' is not a device; write cpu, cuda, cuda:1 or mps."),
    ("meta", "'meta' is not a device"),
    ("cuda:99", "cuda:99: this machine has"),
])
def test_devices_are_checked_when_parsed(text: str, message: str):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace(".", r"\.")):
        device_argument(text)
    assert device_argument("cpu") == "cpu"


def test_the_number_of_passkey_digits_is_checked_with_the_grid():
    with pytest.raises(ValueError, match=r"num_digits must be an integer in \[1, 18\], got 19"):
        check_passkey_grid([900], [0.5], num_digits=19)


def test_plan_context_reads_lengths_with_units_and_names_bad_segments(capsys):
    module = load_script("plan_context")
    assert module.parse_args(["--seq-len", "64K", "--devices", "2"]).seq_len == 65536
    err = refused(module.parse_args, ["--seq-len", "4096", "--devices", "1",
                                      "--segments", "2048,4k", "--rates", "1,2"], capsys)
    assert "argument --segments: expected integers separated by commas" in err
    assert "'2048,4k'" in err


def test_a_checkpoint_is_not_a_config_to_plan(tmp_path: Path):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"PK\x03\x04\x80\xff binary")
    with pytest.raises(UsageError, match=r"last\.ckpt is not a config\.json.*longnet export"):
        model_config(checkpoint)


def test_a_bad_benchmark_pattern_says_why():
    with pytest.raises(argparse.ArgumentTypeError, match=r"'2048,4096/1' as a pattern \(2 "
                       r"segment lengths but 1 rates\); write geometric"):
        pattern_argument("2048,4096/1")


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0"], "argument --heads: expected a positive integer, got '0'"),
    (["--lengths", "0"], "argument --lengths: lengths must be at least 1, got '0'"),
    (["--repeats", "0"], "argument --repeats: expected a positive integer"),
])
def test_bench_attention_refuses_empty_shapes(argv: list[str], message: str, capsys):
    assert message in refused(load_script("bench_attention").parse_args, argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (["--base-segment", "0"], "argument --base-segment: lengths must be at least 1"),
    (["--worlds", "0"], "argument --worlds: expected a positive integer, got '0'"),
    (["--transports", "nccl"], "argument --transports: invalid choice: 'nccl'"),
    (["--seq-len", "100", "--base-segment", "16", "--worlds", "1", "3", "--dense-seq-len", "0",
      "--grad-seq-len", "0"], "--seq-len 100 cannot be split over 3 ranks"),
    (["--seq-len", "6144", "--worlds", "3", "--dense-seq-len", "1000", "--grad-seq-len", "0"],
     "--dense-seq-len 1000 cannot be split over 3 ranks"),
])
def test_bench_ring_refuses_what_its_ranks_cannot_run(argv: list[str], message: str, capsys):
    assert message in refused(load_script("bench_ring").parse_args, argv, capsys)


def test_bench_training_checks_the_model_before_any_step(tmp_path: Path, capsys):
    module = load_script("bench_training")
    err = refused(module.parse_args, ["--model", "longnet-nope", "--lengths", "64"], capsys)
    assert "--model: model 'longnet-nope' is neither a zoo name" in err
    assert module.parse_args(["--model", "longnet-tiny", "--lengths", "1K"]).config.num_layers


@pytest.mark.parametrize("name, argv, message", [
    ("bench_load_balance", ["--seq-len", "0"], "argument --seq-len: lengths must be at least 1"),
    ("bench_load_balance", ["--steps", "0"], "argument --steps: expected a positive integer"),
    ("eval_passkey", ["--models", "m", "--num-digits", "0"], "argument --num-digits"),
])
def test_counts_and_lengths_are_positive(name: str, argv: list[str], message: str, capsys):
    parse = (load_script(name).parse_args if name.startswith("bench") else
             lambda argv: command_parser().parse_args(["eval", "passkey", *argv]))
    assert message in refused(parse, argv, capsys)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO)


def test_demo_refuses_an_empty_sequence():
    done = run("-m", "lab.scripts.demo_attention", "--seq-len", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --seq-len: lengths must be at least 1" in done.stderr


def test_a_script_error_is_two_lines_and_verbose_adds_the_traceback(tmp_path: Path):
    """As the ``longnet`` command: the message and a line naming --verbose; --verbose
    (anywhere) prints the traceback too."""
    argv = ["-m", "lab.scripts.chunk_state", "unpack", str(tmp_path), str(tmp_path / "last.ckpt")]
    done = run(*argv)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: no index.json in {tmp_path}: not a folder written by lab.scripts.chunk_state "
        "pack.", "(run again with --verbose to see the traceback)"], done.stderr
    done = run(*argv[:2], "--verbose", *argv[2:])
    assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
    assert done.stderr.splitlines()[-2].startswith("error: no index.json")


def test_eval_harness_without_lm_eval_says_what_to_install(tmp_path: Path):
    done = run("-c", "import sys; sys.modules['lm_eval'] = None; from longnet.cli import main; "
               f"sys.exit(main(['eval', 'harness', '--models', 'm', '--out', '{tmp_path}']))")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs EleutherAI's lm-eval" in done.stderr
    assert 'pip install -e ".[eval-harness]"' in done.stderr


def test_a_failed_table_write_keeps_the_earlier_results(tmp_path: Path):
    table = tmp_path / "perplexity.csv"
    table.write_text("model,bits_per_byte\nearlier,1.9\n")
    with pytest.raises(ValueError, match="not in fieldnames"):  # the second row is malformed
        write_csv([{"model": "new", "bits_per_byte": 1.8}, {"model": "x", "typo": 1}], table)
    assert table.read_text() == "model,bits_per_byte\nearlier,1.9\n"
    assert [p.name for p in tmp_path.iterdir()] == ["perplexity.csv"]  # no temporary left


def test_no_document_of_every_split_reads_plainly(tmp_path: Path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"^no document in the files corpus \(0 non-empty"):
        load_eval_documents(str(tmp_path / "empty.txt"), split="all")
