"""A run's labelled passkey loss by alignment (``longnet.eval.passkey_training`` and
``scripts/passkey_training_loss.py``): the steps it finds in a real run's log are the steps
that trained on a passkey example, with that example's copy distance (counted here from the
window's text) and the loss the step computed; alignments, spans and bad runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml

from longnet.eval.passkey_training import (
    PasskeyStep,
    alignment,
    loss_by_alignment,
    read_passkey_steps,
)
from longnet.training import LengthCurriculum
from longnet.validation import UsageError
from tests.scripts import load_script
from tests.unit.test_handoff import REPO, fit

HERE = "tests.unit.test_passkey_training_loss"
STEPS, WINDOW, SEED = 12, 256, 5
PATTERN = {"segment_lengths": [16, WINDOW], "dilation_rates": [1, 2]}
script = load_script("passkey_training_loss")


class Recorder(L.Callback):
    """Append a JSON line per optimizer step to ``path``: the step, its one window's bytes (as
    the step trains them) and the loss it computed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._window: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._window = batch["input_ids"][0].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {"step": trainer.global_step - 1, "window": self._window,
                  "loss": float(outputs["loss"])}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def run_config(path: Path, cache: Path, record: Path, *, devices: int = 1) -> Path:
    """The smoke run on one byte-level window of ``WINDOW`` per step, logged at every step,
    half the windows passkey examples (recall labels), a ``Recorder`` last."""
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=STEPS, val_check_interval=STEPS, limit_val_batches=1,
                   log_every_n_steps=1, enable_progress_bar=False, devices=devices)
    trainer["callbacks"] = [
        {"class_path": "longnet.training.LengthCurriculum",
         "init_args": {"stages": [{"step": 0, "seq_len": WINDOW}], "passkey_fraction": 0.5,
                       "passkey_label_mode": "recall", "seed": SEED}},
        {"class_path": f"{HERE}.Recorder", "init_args": {"path": str(record)}},
    ]
    config["test_after_fit"] = False
    config["model"]["init_args"]["overrides"].update(max_positions=WINDOW, **PATTERN)
    config["data"]["init_args"].update(cache_dir=str(cache), batch_size=1, seq_len=WINDOW)
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """A finished run folder and its ``Recorder`` records by step."""
    root = tmp_path_factory.mktemp("passkey-run")
    record = root / "record.jsonl"
    config = run_config(root / "run.yaml", root / "cache", record)
    assert fit(config, root, "run") == 0
    lines = map(json.loads, record.read_text().splitlines())
    return root / "run", {line["step"]: line for line in lines}


def copy_distance_of(window: list[int]) -> int | None:
    """The copy distance of a byte-level passkey window (prompt + key), counted from its text:
    from the needle key's first digit to the byte before the answer's; None for a corpus
    window."""
    text = bytes(window).decode("latin-1")
    prefix = "The pass key is "
    if prefix not in text:
        return None
    needle = text.index(prefix) + len(prefix)
    key = text[needle:needle + 5]
    return text.rindex(key) - 1 - needle


def test_the_steps_found_are_the_passkey_steps_with_their_distance_and_loss(run):
    folder, records = run
    found = read_passkey_steps(folder / "config.yaml", folder / "metrics.csv")
    expected = {step: copy_distance_of(record["window"]) for step, record in records.items()}
    passkey_steps = sorted(step for step, distance in expected.items() if distance is not None)
    assert 2 <= len(passkey_steps) <= STEPS - 2  # half the windows, drawn
    assert found.logged_steps == STEPS
    assert [item.step for item in found.steps] == passkey_steps
    for item in found.steps:
        assert item.seq_len == WINDOW
        assert item.copy_distance == expected[item.step] > 0, item.step
        assert item.loss == pytest.approx(records[item.step]["loss"], rel=1e-5), item.step
    assert (found.rate, found.dense_reach) == (2, 16)


def test_the_script_writes_every_step_and_the_plot(run, tmp_path, capsys):
    folder, records = run
    assert script.main([str(folder), "--out", str(tmp_path), "--span", "4"]) == 0
    printed = capsys.readouterr().out
    assert "to rate 2, the largest" in printed and "median_loss" in printed
    with open(tmp_path / "passkey_training_loss.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [
        step for step, record in sorted(records.items()) if copy_distance_of(record["window"])]
    for row in rows:
        assert row["alignment"] == alignment(int(row["copy_distance"]), 2, 16)
    assert (tmp_path / "passkey_training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("distance", "expected"), [
    (16, "near"), (17, "misaligned"), (18, "aligned"), (0, "near"), (64, "aligned")])
def test_alignment_counts_near_copies_apart(distance, expected):
    assert alignment(distance, 2, 16) == expected


def test_without_a_dense_branch_every_copy_is_aligned_or_not():
    assert [alignment(d, 4, 0) for d in (1, 4, 6, 8)] == [
        "misaligned", "aligned", "misaligned", "aligned"]
    with pytest.raises(ValueError, match="rate must be a positive integer"):
        alignment(3, 0, 0)


def test_loss_by_alignment_groups_spans_and_alignments_in_order():
    steps = [PasskeyStep(1, 64, 40, 1.0), PasskeyStep(2, 64, 41, 3.0),
             PasskeyStep(3, 64, 42, 2.0), PasskeyStep(9, 64, 5, 0.5),
             PasskeyStep(12, 64, 43, 4.0), PasskeyStep(14, 64, 45, 1.0),
             PasskeyStep(15, 64, 47, 2.0)]
    rows = loss_by_alignment(steps, rate=2, dense_reach=8, span=10)
    assert [(r["from_step"], r["to_step"], r["alignment"], r["steps"]) for r in rows] == [
        (0, 9, "near", 1), (0, 9, "aligned", 2), (0, 9, "misaligned", 1),
        (10, 19, "misaligned", 3)]
    assert rows[1]["mean_loss"] == rows[1]["median_loss"] == 1.5
    assert rows[3]["mean_loss"] == pytest.approx(7 / 3)
    assert rows[3]["median_loss"] == 2.0


def test_passkey_draws_are_the_windows_the_curriculum_replaces():
    curriculum = LengthCurriculum([{"step": 0, "seq_len": WINDOW}], passkey_fraction=0.5,
                                  seed=SEED)
    examples = curriculum.passkey_examples(WINDOW)
    batch = {"input_ids": torch.full((4, WINDOW), 7), "labels": torch.full((4, WINDOW), 8)}
    draws = curriculum.passkey_draws(3, 4)
    module = SimpleNamespace(log=lambda *args, **kwargs: None)
    trainer = SimpleNamespace(global_step=3, global_rank=0, world_size=1)
    curriculum.on_train_batch_start(trainer, module, batch, 0)
    replaced = [row for row in range(4) if not (batch["input_ids"][row] == 7).all()]
    assert replaced == [row for row, _ in draws]
    for row, index in draws:
        assert torch.equal(batch["input_ids"][row], examples[index]["input_ids"])
    assert LengthCurriculum([{"step": 0, "seq_len": WINDOW}]).passkey_draws(3, 4) == []


def write_run(folder: Path, trainer: dict, batch_size: int = 1) -> Path:
    """A run folder of a config (``trainer``, the data's ``batch_size``) and a short log."""
    folder.mkdir(parents=True)
    config = {"trainer": trainer, "model": {"init_args": {"config": PATTERN}},
              "data": {"init_args": {"seq_len": WINDOW, "batch_size": batch_size}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.csv").write_text("step,train/loss\n0,1.0\n1,2.0\n")
    return folder


def curriculum(fraction: float) -> dict:
    return {"class_path": "longnet.training.LengthCurriculum",
            "init_args": {"stages": [{"step": 0, "seq_len": WINDOW}],
                          "passkey_fraction": fraction}}


def read(folder: Path):
    return read_passkey_steps(folder / "config.yaml", folder / "metrics.csv")


def test_runs_the_split_cannot_read_are_refused_naming_why(tmp_path):
    with pytest.raises(UsageError, match="no file .*config.yaml and .*metrics.csv"):
        read(tmp_path)
    plain = write_run(tmp_path / "plain", {"callbacks": [curriculum(0.0)]})
    with pytest.raises(UsageError, match="trains no passkey examples"):
        read(plain)
    several = write_run(tmp_path / "ddp", {"devices": 2, "callbacks": [curriculum(0.5)]})
    with pytest.raises(UsageError, match="devices=2.*only single-device runs"):
        read(several)
    trained_bpe = write_run(tmp_path / "bpe", {"callbacks": [curriculum(0.5)]})
    config = yaml.safe_load((trained_bpe / "config.yaml").read_text())
    config["data"]["init_args"]["tokenizer"] = "bpe:512"
    (trained_bpe / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UsageError, match="'bpe:512' is a BPE it trained: give the run folder"):
        read(trained_bpe)
    batched = write_run(tmp_path / "batched", {"callbacks": [curriculum(0.5)]}, batch_size=2)
    found = read(batched)
    assert (found.steps, found.logged_steps, found.rate, found.dense_reach) == ([], 2, 2, 16)
    with pytest.raises(UsageError, match=r"none of the 2 logged steps .*\(batch_size 1"):
        script.main([str(batched)])


def test_the_script_needs_a_run_folder_or_all_of_its_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--config", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2
    assert "give a run folder, or --config, --metrics and --out" in capsys.readouterr().err
