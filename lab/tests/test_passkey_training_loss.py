"""A run's labelled passkey loss by how its heads see the copy (``lab.passkey_training``
and ``lab/scripts/passkey_training_loss.py``): the steps it finds in a real run's log are the
steps that trained on one passkey example, with that example's copy (counted here from the
window's text, its visibility by hand) and its labelled loss (computed here from the model's
logits), on one window per step or several; visibility, spans and bad runs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml

from lab.passkey_training import (
    PasskeyStep,
    loss_by_visibility,
    read_passkey_steps,
    visibility,
)
from longnet.attention import DilatedPattern
from longnet.training import LengthCurriculum
from longnet.validation import UsageError
from tests.chunked import fit
from tests.scripts import load_script

HERE = "lab.tests.test_passkey_training_loss"
REPO = Path(__file__).resolve().parents[2]
STEPS, WINDOW, SEED = 12, 256, 5
PATTERN = {"segment_lengths": [16, WINDOW], "dilation_rates": [1, 2]}
script = load_script("passkey_training_loss")


class Recorder(L.Callback):
    """Append a JSON line per optimizer step to ``path``: the step, its windows' bytes (as
    the step trains them), each window's mean loss over its labelled tokens (from the model's
    logits before the step's update) and the loss the step computed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._windows: list[list[int]] = []
        self._labelled: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._windows = batch["input_ids"].tolist()
        with torch.no_grad():
            logits = pl_module.model(batch["input_ids"]).logits
        scored = batch["labels"] != -100
        self._labelled = [
            float(F.cross_entropy(logits[row][scored[row]], batch["labels"][row][scored[row]]))
            for row in range(len(self._windows))]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {"step": trainer.global_step - 1, "windows": self._windows,
                  "labelled": self._labelled, "loss": float(outputs["loss"])}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def run_config(path: Path, cache: Path, record: Path, *, windows: int = 1) -> Path:
    """The smoke run on ``windows`` byte-level windows of ``WINDOW`` per step, logged at every
    step, half the windows passkey examples (recall labels), a ``Recorder`` last."""
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=STEPS, val_check_interval=STEPS, limit_val_batches=1,
                   log_every_n_steps=1, enable_progress_bar=False)
    trainer["callbacks"] = [
        {"class_path": "longnet.training.LengthCurriculum",
         "init_args": {"stages": [{"step": 0, "seq_len": WINDOW}], "passkey_fraction": 0.5,
                       "passkey_label_mode": "recall", "seed": SEED}},
        {"class_path": f"{HERE}.Recorder", "init_args": {"path": str(record)}},
    ]
    config["test_after_fit"] = False
    config["model"]["init_args"]["overrides"].update(max_positions=WINDOW, dropout=0.0,
                                                     **PATTERN)
    config["data"]["init_args"].update(cache_dir=str(cache), batch_size=1,
                                       seq_len=windows * WINDOW)
    path.write_text(yaml.safe_dump(config))
    return path


def finished_run(root: Path, windows: int) -> tuple[Path, dict[int, dict]]:
    """A finished run of ``windows`` windows per step and its ``Recorder`` records by step."""
    record = root / "record.jsonl"
    config = run_config(root / "run.yaml", root / "cache", record, windows=windows)
    assert fit(config, root, "run") == 0
    lines = map(json.loads, record.read_text().splitlines())
    return root / "run", {line["step"]: line for line in lines}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """A finished run of one window per step and its ``Recorder`` records by step."""
    return finished_run(tmp_path_factory.mktemp("passkey-run"), windows=1)


def copy_of(window: list[int]) -> tuple[int, int] | None:
    """``(key, query)`` of a byte-level passkey window (prompt + key), counted from its text:
    the needle key's first digit and the byte before the answer's; None for a corpus
    window."""
    text = bytes(window).decode("latin-1")
    prefix = "The pass key is "
    if prefix not in text:
        return None
    needle = text.index(prefix) + len(prefix)
    return needle, text.rindex(text[needle:needle + 5]) - 1


def copy_distance_of(window: list[int]) -> int | None:
    copy = copy_of(window)
    return None if copy is None else copy[1] - copy[0]


def visibility_of(key: int, query: int) -> str:
    """The test model's pattern (16, 1), (256, 2) with 2 heads (offsets 0 and 1 at rate 2),
    by hand: the rate-1 branch sees a key in the query's 16-token segment; the rate-2 branch,
    whose one segment is the window, a key at an even distance."""
    if key // 16 == query // 16:
        return "dense"
    return "sparse" if (query - key) % 2 == 0 else "unseen"


def test_the_steps_found_are_the_passkey_steps_with_their_distance_and_loss(run):
    folder, records = run
    found = read_passkey_steps(folder / "config.yaml", folder / "metrics.csv")
    expected = {step: copy_distance_of(record["windows"][0])
                for step, record in records.items()}
    passkey_steps = sorted(step for step, distance in expected.items() if distance is not None)
    assert 2 <= len(passkey_steps) <= STEPS - 2  # half the windows, drawn
    assert found.logged_steps == STEPS
    assert [item.step for item in found.steps] == passkey_steps
    for item in found.steps:
        record = records[item.step]
        assert item.seq_len == WINDOW
        assert item.copy_distance == expected[item.step] > 0, item.step
        key, query = copy_of(record["windows"][0])
        assert (item.query_position, item.visibility) == (query, visibility_of(key, query))
        assert item.loss == pytest.approx(record["labelled"][0], rel=1e-5), item.step
        assert item.loss == pytest.approx(record["loss"], rel=1e-5), item.step
    assert found.pattern.branches == ((16, 1), (WINDOW, 2))
    assert {item.visibility for item in found.steps} >= {"sparse", "unseen"}


def test_on_steps_of_several_windows_the_loss_is_the_passkey_windows_own(tmp_path_factory):
    """Two windows per step: a step with one passkey window is found with that window's
    labelled loss (not the step's, mostly corpus text); a step with two is left out."""
    folder, records = finished_run(tmp_path_factory.mktemp("passkey-windows"), windows=2)
    found = {item.step: item for item in read_passkey_steps(folder / "config.yaml",
                                                            folder / "metrics.csv").steps}
    with open(folder / "metrics.csv", newline="") as handle:
        logged = {int(row["step"]): float(row["train/passkey_loss"])
                  for row in csv.DictReader(handle) if row.get("train/loss")}
    assert sorted(logged) == sorted(records)  # every step, NaN without a passkey window
    single = set()
    for step, record in records.items():
        marked = [row for row, window in enumerate(record["windows"])
                  if copy_distance_of(window) is not None]
        assert math.isnan(logged[step]) != bool(marked), step
        if len(marked) == 1:
            single.add(step)
            (row,) = marked
            assert found[step].copy_distance == copy_distance_of(record["windows"][row])
            assert found[step].loss == pytest.approx(record["labelled"][row], rel=1e-5)
            assert abs(found[step].loss - record["loss"]) > 1e-4  # not the step's
    assert set(found) == single
    assert 0 < len(single) < sum(not math.isnan(loss) for loss in logged.values())


def test_the_script_writes_every_step_and_the_plot(run, tmp_path, capsys):
    folder, records = run
    assert script.main([str(folder), "--out", str(tmp_path), "--span", "4"]) == 0
    printed = capsys.readouterr().out
    assert "((16, 1), (256, 2))" in printed and "median_loss" in printed
    with open(tmp_path / "passkey_training_loss.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [
        step for step, record in sorted(records.items()) if copy_distance_of(record["windows"][0])]
    for row in rows:
        query, distance = int(row["query_position"]), int(row["copy_distance"])
        assert row["visibility"] == visibility_of(query - distance, query)
    assert (tmp_path / "passkey_training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("key", "query", "expected"), [
    (20, 20, "dense"), (16, 31, "dense"),  # one 16-token segment, any distance
    (15, 17, "sparse"),  # two tokens apart but across a segment boundary: rate 2 only
    (20, 40, "sparse"), (20, 41, "unseen"), (0, 255, "unseen"), (1, 255, "sparse"),
    (200, 300, "unseen"),  # even, but in two 256-token segments
])
def test_visibility_follows_the_segments_and_offsets(key, query, expected):
    pattern = DilatedPattern.coerce([(16, 1), (256, 2)])
    assert visibility(pattern, 2, query, key) == expected


def test_a_rate_without_a_head_at_the_query_offset_does_not_see():
    """Rate 4 with 2 heads: offsets 0 and 1 only, so a query at offset 2 or 3 sees nothing."""
    pattern = DilatedPattern.coerce([(8, 1), (64, 4)])
    assert [visibility(pattern, 2, query, query - 16) for query in (32, 33, 34, 35)] == [
        "sparse", "sparse", "unseen", "unseen"]
    with pytest.raises(ValueError, match="must not come after the query"):
        visibility(pattern, 2, 3, 5)


def test_loss_by_visibility_groups_spans_and_visibilities_in_order():
    steps = [PasskeyStep(1, 64, 50, 40, "sparse", 1.0),
             PasskeyStep(2, 64, 50, 41, "unseen", 3.0),
             PasskeyStep(3, 64, 50, 42, "sparse", 2.0), PasskeyStep(9, 64, 50, 5, "dense", 0.5),
             PasskeyStep(12, 64, 50, 43, "unseen", 4.0),
             PasskeyStep(14, 64, 50, 45, "unseen", 1.0),
             PasskeyStep(15, 64, 50, 47, "unseen", 2.0)]
    rows = loss_by_visibility(steps, span=10)
    assert [(r["from_step"], r["to_step"], r["visibility"], r["steps"]) for r in rows] == [
        (0, 9, "dense", 1), (0, 9, "sparse", 2), (0, 9, "unseen", 1),
        (10, 19, "unseen", 3)]
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
    assert batch["passkey_rows"].tolist() == [row in replaced for row in range(4)]
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
    with pytest.raises(UsageError, match="no train/passkey_loss, and on 2 devices"):
        read(several)
    auto = write_run(tmp_path / "auto", {"devices": "auto", "callbacks": [curriculum(0.5)]})
    with pytest.raises(UsageError, match="devices='auto'.*device count as numbers"):
        read(auto)
    trained_bpe = write_run(tmp_path / "bpe", {"callbacks": [curriculum(0.5)]})
    config = yaml.safe_load((trained_bpe / "config.yaml").read_text())
    config["data"]["init_args"]["tokenizer"] = "bpe:512"
    (trained_bpe / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UsageError, match="'bpe:512' is a BPE it trained: give the run folder"):
        read(trained_bpe)
    batched = write_run(tmp_path / "batched", {"callbacks": [curriculum(0.5)]}, batch_size=2)
    found = read(batched)
    assert (found.steps, found.logged_steps) == ([], 2)
    with pytest.raises(UsageError, match=r"none of the 2 logged steps .*exactly one"):
        script.main([str(batched)])


def test_on_several_devices_the_steps_with_one_example_over_all_ranks_are_found(tmp_path):
    """Two ranks of two windows each: a step counts when exactly one of its four windows, on
    either rank, is a passkey example; its loss is the logged train/passkey_loss."""
    folder = write_run(tmp_path / "ddp", {"devices": 2, "callbacks": [curriculum(0.3)]},
                       batch_size=2)
    rows = ["step,train/loss,train/passkey_loss"] + [
        f"{step},9.0,{'nan' if step == 7 else step / 10}" for step in range(40)]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    run = read(folder)
    drawn = LengthCurriculum([{"step": 0, "seq_len": WINDOW}], passkey_fraction=0.3)
    examples = drawn.passkey_examples(WINDOW)
    expected = {}
    for step in range(40):
        draws = [index for rank in range(2) for _, index in drawn.passkey_draws(step, 2, rank, 2)]
        if len(draws) == 1 and step != 7:
            expected[step] = len(examples.example(draws[0]).prompt) - 1 - \
                examples.example(draws[0]).key_start
    assert len(expected) >= 5 and run.logged_steps == 40
    assert {item.step: item.copy_distance for item in run.steps} == expected
    assert all(item.loss == item.step / 10 for item in run.steps)


def test_the_script_needs_a_run_folder_or_all_of_its_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--config", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2
    assert "give a run folder, or --config, --metrics and --out" in capsys.readouterr().err
