"""What a tester found the ``longnet`` command and its ``export`` (then a script) doing
without a word (issue 41): empty paths taken as the current folder, ``test``/``validate``/
``predict`` scoring random weights, ``predict`` writing nothing, ``default_root_dir`` ignored,
tracebacks for ``overfit_batches`` and ``--ckpt_path hpc``. Each is now refused in a few
lines naming the value and the fix, or does what was asked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from longnet.cli import main
from longnet.modeling import LongNetConfig, LongNetLM

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
SMOKE_SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=64,
                   segment_lengths=(16, 32, 64), dilation_rates=(1, 2, 4))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory) -> Path:
    """A ``save_pretrained`` folder of the smoke model's shape (what ``pretrained:`` loads)."""
    folder = tmp_path_factory.mktemp("pretrained") / "model"
    LongNetLM(LongNetConfig(**SMOKE_SHAPE)).save_pretrained(folder)
    return folder


def smoke_args(subcommand: str, root: Path, cache: Path, *extra: str) -> list[str]:
    return [subcommand, "--config", str(SMOKE), f"--trainer.logger.init_args.save_dir={root}",
            f"--data.init_args.cache_dir={cache}", *extra]


def refused(args: list[str], capsys, message: str) -> str:
    """Run the command: exit status 2, ``message`` (a regex) in a few lines, no traceback."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 8, err
    assert re.search(message, err, re.DOTALL), err
    return err


@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_evaluating_random_weights_is_refused(tmp_path, data_cache, capsys, subcommand):
    """Without --ckpt_path the configured model (``model:``, a shape) has fresh weights: the
    command reported the bits per byte of random weights and exited 0."""
    refused(smoke_args(subcommand, tmp_path, data_cache), capsys,
            rf"longnet {subcommand} without --ckpt_path would use the randomly initialised "
            r"weights of model: longnet-tiny.*--ckpt_path last\|best\|PATH \(last: this run "
            r"folder's checkpoints/last.ckpt\).*"
            r"--model.init_args.pretrained")
    assert not (tmp_path / "smoke" / "metrics.json").exists()


def test_pretrained_weights_need_no_checkpoint_and_predict_writes_by_default(
    tmp_path, data_cache, trained_folder, capsys
):
    """``pretrained:`` weights are trained ones; ``predict`` without a writer wrote nothing."""
    weights = [f"--model.init_args.pretrained={trained_folder}", "--model.init_args.model=null",
               "--model.init_args.overrides=null"]
    assert main(smoke_args("predict", tmp_path, data_cache, *weights,
                           "--trainer.limit_predict_batches=1")) == 0
    written = tmp_path / "smoke" / "predictions-0.jsonl"
    assert f"Predictions: {written}" in capsys.readouterr().out
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(rows) == 8 and {"index", "loss_sum", "num_tokens", "bpb"} <= set(rows[0])
    # a second predict replaces the file (it appended: 16 rows)
    assert main(smoke_args("predict", tmp_path, data_cache, *weights,
                           "--trainer.limit_predict_batches=1")) == 0
    assert [json.loads(line) for line in written.read_text().splitlines()] == rows


@pytest.mark.parametrize(("extra", "message"), [
    (["--ckpt_path=hpc"], r"--ckpt_path hpc: .*give last \(this run folder's "
                          r"checkpoints/last.ckpt\), best .* or the path of a checkpoint"),
    (["--ckpt_path="], r"--ckpt_path is empty; give last \(this run folder's"),
    (["--trainer.default_root_dir="], r"--trainer.default_root_dir is empty; give a path"),
    (["--trainer.default_root_dir=elsewhere"],
     r"--trainer.default_root_dir elsewhere is not where this run goes: the run folder is the "
     r"logger's, .*/smoke .*--trainer.logger.init_args.save_dir \. "
     r"--trainer.logger.init_args.name elsewhere"),
    (["--trainer.logger.init_args.save_dir="], r"save_dir is empty; give the folder"),
    (["--trainer.limit_test_batches=0"],
     r"--trainer.limit_test_batches 0 leaves longnet test nothing to do"),
    (["--trainer.callbacks+=longnet.training.PredictionsWriter",
      "--trainer.callbacks.dirpath="], r"PredictionsWriter dirpath is empty"),
])
def test_bad_paths_and_checkpoints_are_refused(tmp_path, data_cache, capsys, monkeypatch,
                                               extra, message):
    monkeypatch.chdir(tmp_path)
    refused(smoke_args("test", tmp_path, data_cache, *extra), capsys, message)
    assert not (tmp_path / "smoke" / "metrics.json").exists()


def test_overfit_batches_with_the_resumable_data_order_is_refused(tmp_path, data_cache, capsys):
    refused(smoke_args("fit", tmp_path, data_cache, "--trainer.overfit_batches=1"), capsys,
            r"--trainer.overfit_batches 1 needs Lightning's own data loaders.*"
            r"--model.init_args.resumable_data false")


def test_a_checkpoint_folder_given_as_empty_is_refused(tmp_path, data_cache, capsys, monkeypatch):
    """ModelCheckpoint(dirpath="") wrote its checkpoints into the current folder."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  callbacks:\n"
                      "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {dirpath: ''}\n")
    refused(smoke_args("fit", tmp_path, data_cache, "--config", str(config)), capsys,
            r"ModelCheckpoint dirpath is empty")
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


@pytest.mark.parametrize(("argv", "message"), [
    (["{ckpt}", ""], "OUTPUT is empty; give a path"),
    (["{ckpt}", "."], r"OUTPUT \. is the current folder: it would be replaced whole"),
    (["", "model"], "CHECKPOINT is empty; give a path"),
])
def test_export_refuses_an_empty_path(tmp_path, capsys, monkeypatch, argv, message):
    """``longnet export CKPT ""`` replaced the current folder by the model, exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("mine")
    argv = [arg.replace("{ckpt}", str(tmp_path / "missing.ckpt")) for arg in argv]
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert os.listdir(tmp_path) == ["README.md"] and os.getcwd() == str(tmp_path)
