"""The ``longnet`` command end to end, in-process (``longnet.cli.main``), on the smoke config:
fit then test from one command, the run folder, the other subcommands, config errors, every
expected failure (exit status 2, the value named, no traceback) and two fits into one folder."""

from __future__ import annotations

import csv
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

import longnet.cli.entry
from longnet.cli import main
from longnet.cli.entry import run_cli
from longnet.modeling import LongNetConfig, LongNetLM

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "lab" / "configs").glob("*.yaml")])
SMOKE = REPO / "configs" / "smoke.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


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
    test = summary["test"]  # bits per byte: over the bytes, not the tokens (each EOS)
    assert test["test/bpb"] == pytest.approx(
        test["test/loss"] * test["test/tokens"] / test["test/bytes"] / 0.6931472, rel=1e-5)
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
    assert main(["fit", "--config", str(SMOKE), "--model.init_args.learning_rat=0.1"]) == 2
    err = capsys.readouterr().err
    assert "longnet.training.CausalLMModule has no option 'learning_rat'; did you mean " \
        "'learning_rate'" in err
    assert len(err.splitlines()) == 2 and "fit --help" in err, err


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-configs")
    config = yaml.safe_load(SMOKE.read_text())
    config["trainer"]["max_stepz"] = 3
    (root / "typo.yaml").write_text(yaml.safe_dump(config))
    (root / "binary.yaml").write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff" + bytes(300))
    return root


PARSE_ERRORS = [  # (arguments ({bad} = the bad_configs folder), what the one line says)
    (["--trainer.max_steps=abc"], "--trainer.max_steps: Expected a <class 'int'>. Got value: abc"),
    (["--trainer.precision=17"], "--trainer.precision: '17' is not one of 64, 32, 16, "),
    (["--model.init_args.overrides={hidden_size: [}"],
     "--model.init_args.overrides: '{hidden_size: [}' is not a dict"),
    (["--data.init_args.seq_len=1.5"],
     "--data.init_args.seq_len: Expected a <class 'int'>. Got value: 1.5"),
    (["--trainer.max_stepz=3"], "unrecognized arguments: --trainer.max_stepz"),
    (["--trainer.callbacks+=longnet.training.Nope"],
     "--trainer.callbacks: module 'longnet.training' has no attribute 'Nope'"),
    (["--config={bad}/typo.yaml"], "Subcommand 'fit' does not accept option 'trainer.max_stepz'"),
    (["--config={bad}/missing.yaml"], "--config: File does not exist: '{bad}/missing.yaml'"),
]


@pytest.mark.parametrize(("extra", "line"), PARSE_ERRORS)
def test_parse_errors_are_one_line_naming_the_key(bad_configs, capsys, extra, line):
    """jsonargparse's errors without its usage dump (51-60 lines) and without the union
    alternatives that do not apply: the key, the value, a pointer to --help."""
    extra = [arg.replace("{bad}", str(bad_configs)) for arg in extra]
    assert main(["fit", "--config", str(SMOKE), *extra]) == 2
    err = capsys.readouterr().err
    assert f"longnet: error: {line.replace('{bad}', str(bad_configs))}" in err, err
    assert err.endswith("(run longnet fit --help for the options; add --verbose for the "
                        "parser's whole message)\n"), err
    assert "usage:" not in err and len(err.splitlines()) <= 3, err


def test_a_binary_config_file_is_named(bad_configs, capsys):
    err = fails(["fit", "--config", str(bad_configs / "binary.yaml")], capsys)
    assert f"{bad_configs / 'binary.yaml'} is not a text config file (invalid" in err, err
    assert len(err.splitlines()) == 2, err


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

    monkeypatch.setattr("longnet.cli.entry.run_cli", bug)
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

    monkeypatch.setattr(longnet.cli.entry, "run_cli", run_and_record)
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


# ---------------------------------------------------------------------- a run that ends badly
@contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """``folder`` cannot be written in while the block runs: immutable (``chattr +i``) for
    root, who ignores permission bits, read-only for anyone else."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root without chattr +i: cannot make a folder unwritable")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("where", ["parent", "run folder", "a file"])
def test_an_unwritable_run_folder_is_refused_before_any_work(tmp_path, capsys, where):
    root = tmp_path / "runs"
    root.mkdir()
    cache = tmp_path / "cache"
    if where == "a file":
        (root / "smoke").write_text("not a folder")
        err = fails(smoke_args("fit", root, cache), capsys)
        assert f"{root / 'smoke'} is a file, not a folder" in err, err
    else:
        folder = root if where == "parent" else root / "smoke"
        folder.mkdir(exist_ok=True)
        with unwritable(folder):
            err = fails(smoke_args("fit", root, cache), capsys)
        assert f"run folder (--trainer.logger.init_args.save_dir and name) {root / 'smoke'}: " \
               f"cannot write in {folder}" in err, err
    assert len(err.splitlines()) == 2 and not cache.exists(), err


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the smoke model 48 wide (the smoke config's is 32)."""
    from longnet.training import CausalLMModule

    config = yaml.safe_load(SMOKE.read_text())["model"]["init_args"]
    module = CausalLMModule(model=config["model"],
                            overrides={**config["overrides"], "hidden_size": 48})
    path = tmp_path_factory.mktemp("wide") / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "global_step": 3}, path)
    return path


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_checkpoint_of_another_shape_is_refused(tmp_path, data_cache, wide_checkpoint, capsys,
                                                  subcommand):
    """Lightning's CLI would build the model from the checkpoint's hyper-parameters (the
    command line's overrides ignored) and write them into the saved config."""
    err = fails(smoke_args(subcommand, tmp_path, data_cache, f"--ckpt_path={wide_checkpoint}"),
                capsys)
    assert f"--ckpt_path {wide_checkpoint} holds a model of another shape than the configured " \
           "one: checkpoint {hidden_size: 48}, configured {hidden_size: 32} " \
           "(model.lm_head.weight: (256, 48) in the checkpoint, (256, 32) configured;" in err, err
    assert "drop the --model.init_args.overrides" in err, err
    assert not (tmp_path / "smoke" / f"config-{subcommand}.yaml").exists()


def test_a_checkpoint_of_another_folder_starts_a_new_run(tmp_path, data_cache, capsys):
    """Resuming another folder's checkpoint is a new run of this folder: its own id (not the
    other run's), and this folder's earlier outputs are refused as for any new run."""
    first = smoke_args("fit", tmp_path / "a", data_cache, "--trainer.max_steps=2",
                       "--trainer.val_check_interval=2", "--test_after_fit=false")
    assert main(first) == 0
    other = run_ids(tmp_path / "a" / "smoke")
    checkpoint = tmp_path / "a" / "smoke" / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    second = smoke_args("fit", tmp_path / "b", data_cache, "--trainer.max_steps=3",
                        "--trainer.val_check_interval=3", "--test_after_fit=false",
                        f"--ckpt_path={checkpoint}")
    assert main(second) == 0
    out = capsys.readouterr().out
    ids = run_ids(tmp_path / "b" / "smoke")
    assert len(ids) == 1 and ids != other, (ids, other)
    assert f"Starting run {next(iter(ids))} from {checkpoint} (step 2 of run " \
           f"{next(iter(other))}, another folder's checkpoint)." in out, out
    err = fails(second, capsys)  # the folder now holds a run: a new one is refused
    assert "holds an earlier run" in err


def smoke_config(path: Path, last_every: int) -> Path:
    """The smoke config with ``LastCheckpoint(every_n_train_steps=last_every)``, at ``path``."""
    config = yaml.safe_load(SMOKE.read_text())
    for callback in config["trainer"]["callbacks"]:
        if isinstance(callback, dict) and callback["class_path"].endswith("LastCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = last_every
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_diverged_run_stops_naming_the_step_and_exports_nothing(tmp_path, data_cache, capsys):
    args = smoke_args("fit", tmp_path, data_cache, "--model.init_args.learning_rate=1e6")
    args[2] = str(smoke_config(tmp_path / "every-step.yaml", last_every=1))
    err = fails(args, capsys)
    match = re.search(r"training diverged at step (\d+): the (loss|gradient norm) is (nan|inf)",
                      err)
    assert match, err
    step = int(match.group(1))
    last = tmp_path / "smoke" / "checkpoints" / "last.ckpt"
    assert f"Last good checkpoint: {last} (step {step - 1})." in err, err
    assert "learning_rate (now 1e+06)" in err and len(err.splitlines()) == 2, err
    run = tmp_path / "smoke"
    assert not (run / "model").exists() and not (run / "metrics.json").exists()
    state = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.isfinite(value).all() for value in state.values())
    assert "Run folder" not in capsys.readouterr().out


class SlowSteps(L.Callback):
    """Sleep ``seconds`` after every training step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


def test_a_run_cut_by_max_time_says_so(tmp_path, data_cache, capsys):
    args = smoke_args("fit", tmp_path, data_cache, "--trainer.max_time=00:00:00:01",
                      "--trainer.callbacks+=tests.unit.test_cli.SlowSteps",
                      "--trainer.callbacks.seconds=0.4")
    assert main(args) == 0
    captured = capsys.readouterr()
    step = json.loads((tmp_path / "smoke" / "metrics.json").read_text())["validate"]["step"]
    assert 0 < step < 30
    assert f"longnet: WARNING: max_time (00:00:00:01) stopped the training at step {step} of " \
           "30, before its learning-rate schedule ended: the model is under-trained." \
           in captured.err, captured.err
    assert "--ckpt_path last --trainer.max_time null" in captured.err
    assert "model stopped by max_time, under-trained" in captured.out


def test_precision_auto_follows_the_hardware(monkeypatch, caplog):
    from longnet.training import trainer as precision

    assert precision.auto_precision("cpu", {"avx2", "amx_bf16"})[0] == "bf16-mixed"
    assert precision.auto_precision("cpu", {"avx512f", "avx512_bf16"}) == (
        "bf16-mixed", "this CPU has bfloat16 matrix units (AVX512-BF16)")
    assert precision.auto_precision("cpu", {"avx2", "avx512f"})[0] == "32-true"
    for flags, chosen in (({"avx2"}, "32-true"), ({"avx2", "amx_bf16"}, "bf16-mixed")):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: flags)
        with caplog.at_level("INFO"):
            trainer = precision.AutoPrecisionTrainer(accelerator="cpu", precision="auto",
                                                     logger=False)
        assert trainer.precision == chosen
        assert f"Precision: {chosen} (auto: this CPU has" in caplog.text
        caplog.clear()
    with pytest.raises(ValueError, match="precision 'auto' chooses for CPU and CUDA"):
        precision.resolve_precision("auto", "mps")
    quickstart = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["trainer"]
    assert (quickstart["precision"], quickstart["accelerator"]) == ("auto", "auto")


def test_metrics_config_and_curves_are_replaced_whole(tmp_path, monkeypatch):
    """A write interrupted before its rename leaves the old file (and no temporary)."""
    from types import SimpleNamespace

    from jsonargparse import ArgumentParser

    from longnet.cli.command import RunConfigSaver
    from longnet.training import MetricsSummary, plot_training_curves

    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                              is_global_zero=True, global_step=7, logger=None,
                              sanity_checking=False,
                              callback_metrics={"val/loss": torch.tensor(2.0)})
    MetricsSummary().on_validation_end(trainer, None)
    parser = ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    RunConfigSaver(parser, parser.parse_args([]), overwrite=True).setup(trainer, None, "fit")
    plot_training_curves({"train/bpb": [(1, 3.0), (2, 2.0)]}, tmp_path / "curves.png")
    names = ("metrics.json", "config.yaml", "curves.png")
    before = {name: (tmp_path / name).read_bytes() for name in names}

    def killed(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr("longnet.files.os.replace", killed)
    trainer.callback_metrics = {"val/loss": torch.tensor(1.0)}
    with pytest.raises(OSError, match="killed"):
        MetricsSummary().on_validation_end(trainer, None)
    with pytest.raises(OSError, match="killed"):
        RunConfigSaver(parser, parser.parse_args(["--steps=2"]), overwrite=True).setup(
            trainer, None, "fit")
    with pytest.raises(OSError, match="killed"):
        plot_training_curves({"train/bpb": [(1, 3.0), (2, 1.0)]}, tmp_path / "curves.png")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names)


class SignalInSetup(L.Callback):
    """Send this process SIGTERM while the trainer sets up (before any step)."""

    def setup(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_before_training_exits_143_in_one_line(tmp_path, data_cache, capsys):
    """Outside a trainer's training (here its setup) a signal stops the command at once:
    status 143, one line (Python's default: killed by the signal; SIGINT: a traceback)."""
    def unhandled(signum, frame):  # what the command must not leave the signal to
        raise RuntimeError("SIGTERM reached the test's handler")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        args = smoke_args("fit", tmp_path, data_cache,
                          "--trainer.callbacks+=tests.unit.test_cli.SignalInSetup")
        assert main(args) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "longnet: interrupted by SIGTERM. Nothing was saved since the last checkpoint: run the "
        "command again (a fit with --ckpt_path last continues from its last checkpoint)."), err
    assert not (tmp_path / "smoke" / "run.lock").exists()
