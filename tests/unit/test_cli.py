"""The ``longnet`` command end to end, in-process (``longnet.cli.main``), on the smoke config:
fit then test from one command, the run folder, the other subcommands, config errors, every
expected failure (exit status 2, the value named, no traceback) and two fits into one folder."""

from __future__ import annotations

import csv
import gc
import json
import os
import re
import subprocess
import sys
import time
import weakref
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

import longnet.cli
from longnet.cli import main, run_cli
from longnet.modeling import LongNetConfig, LongNetLM

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SMOKE = REPO / "configs" / "smoke.yaml"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run as fast on one thread, and do not stall when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


def smoke_args(subcommand: str, root: Path, cache: Path, *extra: str) -> list[str]:
    return [
        subcommand, "--config", str(SMOKE),
        f"--trainer.logger.init_args.save_dir={root}",
        f"--trainer.default_root_dir={root / 'smoke'}",
        f"--data.init_args.cache_dir={cache}",
        *extra,
    ]


def read_metrics(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_fit_then_test_in_one_command(tmp_path, data_cache, capsys):
    assert main(smoke_args("fit", tmp_path, data_cache)) == 0
    run = tmp_path / "smoke"

    # the command ends by naming the export and the plot; the plot is a PNG of the curves
    printed = capsys.readouterr().out
    assert f"Run folder {run}:" in printed
    assert f"{run / 'model'}/" in printed and f"{run / 'curves.png'}" in printed
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    losses = [float(row["train/loss"]) for row in read_metrics(run) if row.get("train/loss")]
    assert len(losses) >= 5
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.5, losses  # the loss falls

    summary = json.loads((run / "metrics.json").read_text())
    assert summary["validate"]["step"] == 30 and summary["test"]["step"] == 30
    for key in ("test/loss", "test/bpb", "test/ppl", "test/accuracy"):
        assert math_ok(summary["test"][key]), summary
    assert summary["test"]["test/bpb"] == pytest.approx(summary["test"]["test/loss"] / 0.6931472)
    assert summary["validate"]["val/bpb"] < 8.0  # below the uniform 8 bits per byte

    # the resolved config, checkpoints and the save_pretrained export are in the run folder
    assert "class_path: longnet.training.CausalLMModule" in (run / "config.yaml").read_text()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    best = next((run / "checkpoints").glob("best-*.ckpt"))
    exported = LongNetLM.from_pretrained(run / "model")
    state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    for key, value in exported.state_dict().items():
        assert torch.equal(value, state[f"model.{key}"]), key

    # the other subcommands on the trained checkpoint
    last = str(run / "checkpoints" / "last.ckpt")
    assert main(smoke_args("validate", tmp_path, data_cache, f"--ckpt_path={last}")) == 0
    assert main(smoke_args("test", tmp_path, data_cache, f"--ckpt_path={last}")) == 0
    assert (run / "config-test.yaml").is_file() and (run / "config-validate.yaml").is_file()
    assert main(smoke_args(
        "predict", tmp_path, data_cache, f"--ckpt_path={last}",
        "--trainer.limit_predict_batches=2",
        "--trainer.callbacks+=longnet.training.PredictionsWriter",
    )) == 0
    rows = [json.loads(line) for line in (run / "predictions-0.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"index", "loss_sum", "num_tokens", "bpb"} <= set(rows[0])


def math_ok(value) -> bool:
    return isinstance(value, float) and value == value and abs(value) != float("inf")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_config_prints(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "longnet.training.CausalLMModule" in printed and "data:" in printed


def test_unknown_key_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(SMOKE), "--model.init_args.learning_rat=0.1"])
    assert exit_info.value.code == 2
    assert "learning_rat" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--data.init_args.data_files=/no/such/folder/*.txt", "data_files: no file matches"),
        ("--model.init_args.model=longnet-nope", "longnet-tiny"),
        ("--model.init_args.learning_rate=-1", "learning_rate must be positive"),
        ("--model.init_args.overrides={num_heads: 3}", "not divisible by num_heads"),
    ],
)
def test_bad_configs_fail_before_any_work(tmp_path, capsys, override, message):
    code = main(smoke_args("fit", tmp_path, tmp_path / "cache", override))
    assert code == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and message in err
    assert not (tmp_path / "smoke").exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------- what a user gets wrong
@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    """Files a user may pass by mistake: checkpoints that are not, data that is not text, a
    model folder whose config.json omits the attention pattern."""
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "random.ckpt").write_bytes(bytes(range(256)) * 20)
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, root / "whole.ckpt")
    (root / "truncated.ckpt").write_bytes((root / "whole.ckpt").read_bytes()[:3000])
    with zipfile.ZipFile(root / "foreign.ckpt", "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    (root / "folder.ckpt").mkdir()
    for name, files in {
        "binary": {**{f"d{i}.txt": f"text number {i} " * 20 for i in range(20)},
                   "a.out": b"\x7fELF\x02\x01\x01\x00" + bytes(256)},
        "empty": {"empty.txt": ""},
        "one-book": {"book.txt": "a long line of text. " * 4000},
    }.items():
        (root / name).mkdir()
        for file, content in files.items():
            path = root / name / file
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    model = root / "no-pattern"
    LongNetLM(LongNetConfig(hidden_size=32, num_layers=1, num_heads=2, max_positions=64,
                            segment_lengths=(32, 64), dilation_rates=(1, 2))).save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    del config["segment_lengths"], config["dilation_rates"]
    (model / "config.json").write_text(json.dumps(config))
    return root


LEARNED_64 = ("--model.init_args.overrides={hidden_size: 32, num_layers: 2, num_heads: 2, "
              "max_positions: 32, position_encoding: learned, segment_lengths: null, "
              "dilation_rates: null}")
BAD_COMMANDS = [  # (subcommand, extra arguments ({bad} = the bad_inputs folder), message)
    ("fit", ["--trainer.max_steps=-5"], r"`max_steps` must be .* You passed in -5"),
    ("fit", ["--trainer.devices=0"], r"devices='0'\)` value is not a valid input"),
    ("fit", ["--trainer.strategy=longnet.training.SequenceParallelStrategy",
             "--trainer.strategy.sequence_parallel_size=2", "--trainer.devices=3"],
     r"sequence_parallel_size=2 does not divide the 3 processes"),
    ("fit", ["--data.init_args.seq_len=0"], r"seq_len must be a positive integer, got 0"),
    ("fit", [LEARNED_64], r"seq_len 64 exceeds the model's max_positions 32"),
    ("fit", ["--model.init_args.model=null", "--model.init_args.pretrained={bad}/no-pattern"],
     r"no-pattern/config.json omits segment_lengths, dilation_rates"),
    ("fit", ["--ckpt_path={bad}/missing.ckpt"],
     r"missing.ckpt: no checkpoint file \(or folder of shards\) there"),
    ("fit", ["--ckpt_path={bad}/folder.ckpt"],
     r"folder.ckpt: no checkpoint file \(or folder of shards\) there"),
    ("fit", ["--ckpt_path={bad}/random.ckpt"], r"random.ckpt is not a checkpoint: torch.save"),
    ("fit", ["--ckpt_path={bad}/truncated.ckpt"], r"truncated.ckpt is not a checkpoint"),
    ("fit", ["--ckpt_path={bad}/foreign.ckpt"], r"cannot read .*foreign.ckpt as a checkpoint"),
    ("test", ["--ckpt_path=best"], r"--ckpt_path best: there is no best checkpoint"),
    ("test", ["--ckpt_path=last"], r"--ckpt_path last: no last checkpoint at .*last.ckpt"),
    ("fit", ["--data.init_args.data_files={bad}/binary/*"], r"a.out: binary: a NUL byte"),
    ("fit", ["--data.init_args.data_files={bad}/empty/*"], r"no document .* in .*empty.txt"),
    ("fit", ["--data.init_args.data_files={bad}/one-book/*"],
     r"1 document from .*book.txt.*at least 3 documents"),
]


def fails(args: list[str], capsys) -> str:
    """Run the command; it must exit with status 2 and no traceback. Returns stderr."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "longnet: " in err, err
    return err


@pytest.mark.parametrize(("subcommand", "extra", "message"), BAD_COMMANDS)
def test_expected_failures_exit_2_naming_the_value(
    tmp_path, data_cache, bad_inputs, capsys, subcommand, extra, message
):
    extra = [arg.replace("{bad}", str(bad_inputs)) for arg in extra]
    cache = tmp_path / "cache" if any("data_files" in arg for arg in extra) else data_cache
    err = fails(smoke_args(subcommand, tmp_path, cache, *extra), capsys)
    assert re.search(message, err, re.DOTALL), err
    assert len(err.splitlines()) <= 12, err


def test_verbose_shows_the_traceback_and_bugs_keep_theirs(tmp_path, capsys, monkeypatch):
    args = smoke_args("fit", tmp_path, tmp_path / "cache", "--trainer.max_steps=-5")
    assert main([*args, "--verbose"]) == 2
    assert "Traceback" in capsys.readouterr().err

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr("longnet.cli.run_cli", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(args)


def test_no_optimizer_step_exports_nothing(tmp_path, data_cache, capsys):
    with pytest.warns(UserWarning, match="no optimizer step .*max_steps=0.* not written"):
        assert main(smoke_args("fit", tmp_path, data_cache, "--trainer.max_steps=0")) == 0
    assert "no test_after_fit" in capsys.readouterr().out
    run = tmp_path / "smoke"
    assert not (run / "model").exists() and not (run / "metrics.json").exists()



def test_nothing_of_a_run_outlives_main(tmp_path, data_cache, monkeypatch):
    """The trainer (and with it the strategy and its process groups) is freed when ``main``
    returns: jsonargparse keeps its last parser in a context variable, and a distributed run's
    groups held from there would be destroyed only while the interpreter shuts down."""
    trainers = []

    def run_and_record(args):
        cli = run_cli(args)
        trainers.append(weakref.ref(cli.trainer))
        return cli

    monkeypatch.setattr(longnet.cli, "run_cli", run_and_record)
    with pytest.warns(UserWarning, match="no optimizer step"):
        assert main(smoke_args("fit", tmp_path, data_cache, "--trainer.max_steps=0")) == 0
    gc.collect()
    assert len(trainers) == 1 and trainers[0]() is None

class WaitForFile(L.Callback):
    """Hold a run before its first step until ``path`` exists (at most two minutes)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer, pl_module) -> None:
        deadline = time.monotonic() + 120
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def run_ids(run: Path) -> set[str]:
    return {row["run_id"] for row in read_metrics(run)}


def test_two_fits_into_one_folder_never_mix(tmp_path, data_cache, capsys):
    """A second fit into a folder a live fit holds is refused naming it; nothing of the first
    run is touched; a new fit into the finished folder is refused; --ckpt_path last resumes
    that run (same id) and says so; progress counts optimizer steps, in plain lines off a
    terminal and in a tqdm bar."""
    run, go = tmp_path / "smoke", tmp_path / "go"
    config = yaml.safe_load(SMOKE.read_text())
    config["trainer"].update(max_steps=4, val_check_interval=2)
    config["trainer"]["callbacks"].append(
        {"class_path": "tests.unit.test_cli.WaitForFile", "init_args": {"path": str(go)}})
    (tmp_path / "wait.yaml").write_text(yaml.safe_dump(config))
    args = smoke_args("fit", tmp_path, data_cache)
    args[2] = str(tmp_path / "wait.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "longnet", *args], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "run.lock").exists() and first.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        holder = json.loads((run / "run.lock").read_text())
        assert holder["pid"] == first.pid
        err = fails([*args, "--trainer.max_steps=3"], capsys)
        assert f"run folder {run} is in use by run {holder['run_id']} (pid {first.pid}" in err
    finally:
        go.touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert "step 4/4 (100%)" in out and "\r" not in out + err, out
    assert "Tip:" not in out + err and "LeafSpec" not in err
    assert run_ids(run) == {holder["run_id"]} and not (run / "run.lock").exists()
    assert "max_steps: 4" in (run / "config.yaml").read_text()
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == [
        "best-step=4.ckpt", "last.ckpt"]

    err = fails(args, capsys)
    assert f"run folder {run} holds an earlier run (checkpoints/best-step=4.ckpt" in err
    assert "--ckpt_path last" in err

    resume = [*args, "--ckpt_path=last", "--trainer.max_steps=6",
              "--trainer.callbacks+=longnet.training.StepProgressBar"]
    assert main(resume) == 0
    out = capsys.readouterr().out
    last = run / "checkpoints" / "last.ckpt"
    assert f"Resuming run {holder['run_id']} from {last} (step 4)." in out
    assert "6/6" in out and "/-" not in out
    assert run_ids(run) == {holder["run_id"]}
    assert torch.load(last, weights_only=True)["longnet_run_id"] == holder["run_id"]
