"""``TimeBudget``: a run planned from its measured step rate is the run a fixed ``max_steps`` of
the planned count gives (same learning rates, same weights), a killed run resumes into the same
plan, a finished one extends, and plans that could not be exact are refused.

The budget's clock is replaced by one that ticks one second per reading, so the plan is the
same on every machine: start at 1 s, the timed steps 1-3 from 2 s to 3 s (2 steps/s), 6 s of
budget of which 2 s are spent: 3 + floor(2 x 4) = 11 steps."""

from __future__ import annotations

import csv

import pytest
import torch

from longnet.cli import main
from longnet.training import TimeBudget
from longnet.validation import UsageError
from tests.unit.test_training_resume import (  # one_thread: as the killed run's process
    callback,
    load,
    one_thread,  # noqa: F401
    run_args,
    run_in_process,
    write_config,
)

PLANNED = 11
BUDGET = dict(training_minutes=0.1, skip_steps=1, measure_steps=2)
HERE = "tests.unit.test_time_budget"


class TickingBudget(TimeBudget):
    """A ``TimeBudget`` whose clock advances one second per reading."""

    ticks = 0.0

    def clock(self) -> float:
        self.ticks += 1.0
        return self.ticks


def budget(**init_args) -> dict:
    return {"class_path": f"{HERE}.TickingBudget", "init_args": {**BUDGET, **init_args}}


def learning_rates(run) -> dict[int, float]:
    with open(run / "metrics.csv") as handle:
        return {int(row["step"]): float(row["lr-AdamW"])
                for row in csv.DictReader(handle) if row.get("lr-AdamW")}


def assert_same_weights(run, expected_run) -> None:
    got, expected = (load(r / "checkpoints" / "last.ckpt") for r in (run, expected_run))
    assert got["global_step"] == expected["global_step"] == PLANNED
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The planned run (a cap of 1,000 steps) and the run with ``max_steps`` fixed to the plan:
    their run folders, and what the planned run printed."""
    root = tmp_path_factory.mktemp("budget")
    planned = write_config(root / "planned.yaml", root / "cache", budget(), steps=1000,
                           val_every=1000)
    fixed = write_config(root / "fixed.yaml", root / "cache", steps=PLANNED, val_every=1000)
    assert main(run_args(planned, root, "planned")) == 0
    assert main(run_args(fixed, root, "fixed")) == 0
    return root, planned


def test_the_planned_run_is_the_fixed_run_of_its_length(runs, capsys):
    root, _ = runs
    assert_same_weights(root / "planned", root / "fixed")
    assert learning_rates(root / "planned") == learning_rates(root / "fixed")
    assert load(root / "planned" / "checkpoints" / "last.ckpt")["callbacks"][
        "TickingBudget"] == {"planned_steps": PLANNED, "planned_under": 1000}


def test_the_plan_is_said_in_one_line(tmp_path, caplog):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(), steps=1000,
                          val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    said = [line for line in caplog.messages if "Time budget" in line]
    assert said == ["Time budget: 0.1 min of training at 2.00 steps/s (measured over steps 1-3)"
                    f" -> {PLANNED} steps; the learning rate decays over them."]


def test_the_cap_bounds_the_plan(tmp_path):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(), steps=7,
                          val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 7


def test_a_killed_run_resumes_into_its_plan(runs, tmp_path):
    root, planned = runs
    killed = write_config(tmp_path / "killed.yaml", tmp_path / "cache", budget(),
                          callback("KillAtStep", step=8), steps=1000, val_every=1000)
    run = run_in_process(run_args(killed, tmp_path, "run"))
    assert run.returncode == 17, run.stderr[-2000:]
    resumed = run_in_process([*run_args(planned, tmp_path, "run"), "--ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed at step 6 of the plan's 11" in resumed.stderr
    assert_same_weights(tmp_path / "run", root / "fixed")


def test_a_finished_run_extends_past_its_plan(runs, tmp_path):
    _, planned = runs
    args = run_args(planned, tmp_path, "run")
    assert main(args) == 0
    assert main([*args, "--ckpt_path=last", "--trainer.max_steps=14"]) == 0
    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 14


def test_a_plan_after_the_warmup_is_refused(tmp_path, capfd):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(measure_steps=9),
                          steps=1000)
    assert main(run_args(config, tmp_path, "run")) != 0
    assert "past the warmup's 5 steps" in capfd.readouterr().err


@pytest.mark.parametrize("minutes", [0, -1.0, float("nan"), "8", True])
def test_a_bad_budget_is_refused(minutes):
    with pytest.raises(UsageError, match="positive number of minutes"):
        TimeBudget(minutes)
