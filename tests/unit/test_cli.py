"""The ``longnet`` command end to end, in-process (``longnet.cli.main``), on the smoke config:
fit then test from one command, the run folder, the other subcommands, and config errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from longnet.cli import main
from longnet.modeling import LongNetLM

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
