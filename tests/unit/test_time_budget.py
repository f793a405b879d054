"""``TimeBudget``: a run planned from its measured step rate is the run a fixed ``max_steps`` of
the planned count gives (same learning rates, same weights), re-plans correct a plan made in a
slow patch with the learning rate continuous, a run killed before or after its plan resumes,
a finished one extends, and bad budgets are refused.

The budget's clock is replaced by one that advances a given time per training step, so the
plans are the same on every machine. At 0.5 s a step, timing steps 1-3 (from 0.5 s to 1.5 s:
2 steps/s) and 30 s of budget of which 1.5 s are spent: 3 + floor(2 x 28.5) = 60 steps; each
re-plan at a share of them (15, 30, 45, 54) measures 2 steps/s again and keeps 60."""

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

PLANNED = 60
BUDGET = dict(training_minutes=0.5, skip_steps=1, measure_steps=2)
HERE = "tests.unit.test_time_budget"


class SteppedBudget(TimeBudget):
    """A ``TimeBudget`` whose clock advances ``seconds`` per training step, ``slow_seconds``
    for the steps of ``slow_steps`` (1-based: the step that ends at ``global_step`` k is k)."""

    def __init__(self, *args, seconds: float = 0.5, slow_steps: list[int] = (),
                 slow_seconds: float = 2.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.now, self.seconds, self.slow_steps, self.slow_seconds = (
            0.0, seconds, set(slow_steps), slow_seconds)

    def clock(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        slow = trainer.global_step in self.slow_steps
        self.now += self.slow_seconds if slow else self.seconds
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def budget(**init_args) -> dict:
    return {"class_path": f"{HERE}.SteppedBudget", "init_args": {**BUDGET, **init_args}}


def learning_rates(run) -> dict[int, float]:
    """The learning rate of the first parameter group at every logged step."""
    with open(run / "metrics.csv") as handle:
        rates = {int(row["step"]): float(row["lr-AdamW/pg1"])
                 for row in csv.DictReader(handle) if row.get("lr-AdamW/pg1")}
    assert rates, f"no learning rate in {run / 'metrics.csv'}"
    return rates


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
    state = load(root / "planned" / "checkpoints" / "last.ckpt")["callbacks"]["SteppedBudget"]
    assert state["plans"] == [[3, 60], [15, 60], [30, 60], [45, 60], [54, 60]]
    assert state["planned_under"] == 1000
    assert state["trained_s"] == 30.0


def test_the_plan_is_said_in_one_line(tmp_path, caplog):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(), steps=1000,
                          val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    said = [line for line in caplog.messages if "Time budget" in line]
    assert said == ["Time budget: 0.5 min of training at 2.00 steps/s (measured over steps 1-3)"
                    f" -> {PLANNED} steps; the learning rate decays over them."]


def test_a_slow_timing_window_is_corrected_with_the_rate_continuous(tmp_path, caplog):
    """Steps 2-3 take 2 s (a neighbour's job): the first plan is 15 steps; the re-plan at step 7
    (half of 15) measures 2 steps/s and fills the budget: 54 steps, 30 s. The learning rate
    never rises after the warmup and ends at its minimum."""
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(slow_steps=[2, 3]),
                          steps=1000, val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    state = checkpoint["callbacks"]["SteppedBudget"]
    assert checkpoint["global_step"] == 54
    assert state["plans"][:2] == [[3, 15], [7, 54]] and state["trained_s"] == 30.0
    assert any("re-planned at step 7: 2.00 steps/s over steps 3-7" in line
               and "-> 54 steps (was 15)" in line for line in caplog.messages)
    rates = [rate for _, rate in sorted(learning_rates(tmp_path / "run").items())]
    warmup = 5
    assert all(b <= a for a, b in zip(rates[warmup:], rates[warmup + 1:]))
    peak, last = rates[warmup], rates[-1]  # the last step's rate is one step above the end
    assert 0.1 * peak < last < 0.101 * peak  # min_lr_ratio 0.1


def test_a_machine_slowed_after_the_last_plan_is_planned_for_at_once(tmp_path, caplog):
    """One plan (step 3: 60 steps), then every step from 20 on takes 1 s instead of 0.5 s. The
    clock read after each step plans again at step 20 (the rate since step 3 says the plan ends
    1.7 s late, past 5 % of 30 s: 56 steps) and at step 22 (1 step/s: 39 steps), which ends at
    29.5 s; without the reads the run trains 60 steps in 50.5 s."""
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache",
                          budget(replan_at=[], slow_steps=list(range(20, 100)), slow_seconds=1.0),
                          steps=1000, val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    state = checkpoint["callbacks"]["SteppedBudget"]
    assert checkpoint["global_step"] == 39
    assert state["plans"] == [[3, 60], [20, 56], [22, 39]] and state["trained_s"] == 29.5
    assert any("re-planned at step 22: 1.00 steps/s over steps 20-22" in line
               for line in caplog.messages)
    rates = [rate for _, rate in sorted(learning_rates(tmp_path / "run").items())]
    assert all(b <= a for a, b in zip(rates[5:], rates[6:]))


def test_training_stops_after_the_step_that_spends_the_budget(tmp_path, caplog):
    """Steps from 30 on take 10 s: re-planned at step 30 (36 steps), the budget is spent after
    step 31 (34.5 s) and training stops there, one step late, not 30 steps (300 s) late."""
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache",
                          budget(replan_at=[], slow_steps=list(range(30, 100)),
                                 slow_seconds=10.0),
                          steps=1000, val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    state = checkpoint["callbacks"]["SteppedBudget"]
    assert checkpoint["global_step"] == 31
    assert state["plans"] == [[3, 60], [30, 36], [31, 31]] and state["trained_s"] == 34.5
    assert any(line.startswith("Time budget: spent after step 31 of the plan's 36")
               for line in caplog.messages)


def test_without_re_plans_the_slow_window_stands(tmp_path):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache",
                          budget(slow_steps=[2, 3], replan_at=[]), steps=1000, val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 15


def test_the_cap_bounds_the_plan(tmp_path):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(), steps=7,
                          val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    assert load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 7


def test_max_steps_before_the_plan_says_the_budget_is_not_applied(tmp_path, caplog):
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", budget(), steps=3,
                          val_every=1000)
    assert main(run_args(config, tmp_path, "run")) == 0
    assert [line for line in caplog.messages if "Time budget" in line] == [
        "Time budget: not applied: max_steps 3 ends the run before step 3, where the budget "
        "would plan; training to 3."]


def test_a_killed_run_resumes_into_its_plan(runs, tmp_path):
    root, planned = runs
    killed = write_config(tmp_path / "killed.yaml", tmp_path / "cache", budget(),
                          callback("KillAtStep", step=8), steps=1000, val_every=1000)
    run = run_in_process(run_args(killed, tmp_path, "run"))
    assert run.returncode == 17, run.stderr[-2000:]
    resumed = run_in_process([*run_args(planned, tmp_path, "run"), "--ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step 6 of the plan's {PLANNED}" in resumed.stderr
    assert_same_weights(tmp_path / "run", root / "fixed")


def test_a_run_killed_inside_the_timing_window_resumes_and_plans(tmp_path):
    """Killed at step 5 of a window of steps 1-7 (its checkpoint at step 3, 1.5 s trained): the
    resumed run times steps 3-9, plans past the warmup (5 steps) with the rate continuous,
    and fills the 30 s budget: 60 steps."""
    slow = budget(measure_steps=6)
    killed = write_config(tmp_path / "killed.yaml", tmp_path / "cache", slow,
                          callback("KillAtStep", step=5), steps=1000, val_every=1000)
    assert run_in_process(run_args(killed, tmp_path, "run")).returncode == 17
    config = write_config(tmp_path / "c.yaml", tmp_path / "cache", slow, steps=1000,
                          val_every=1000)
    resumed = run_in_process([*run_args(config, tmp_path, "run"), "--ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(measured over steps 3-9) -> 60 steps" in resumed.stderr
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == PLANNED
    assert checkpoint["callbacks"]["SteppedBudget"]["trained_s"] == 30.0
    rates = [rate for _, rate in sorted(learning_rates(tmp_path / "run").items())]
    assert all(b <= a for a, b in zip(rates[5:], rates[6:]))


def test_a_finished_run_extends_past_its_plan(runs, tmp_path):
    _, planned = runs
    args = run_args(planned, tmp_path, "run")
    assert main(args) == 0
    assert main([*args, "--ckpt_path=last", f"--trainer.max_steps={PLANNED + 3}"]) == 0
    checkpoint = load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == PLANNED + 3
    assert checkpoint["callbacks"]["SteppedBudget"]["plans"] == [[0, PLANNED + 3]]


@pytest.mark.parametrize("minutes", [0, -1.0, float("nan"), float("inf"), 1e308, 10**400, "8",
                                     True])
def test_a_bad_budget_is_refused(minutes):
    with pytest.raises(UsageError, match="positive number of minutes"):
        TimeBudget(minutes)


@pytest.mark.parametrize("shares", [[0.5, 0.25], [0.0, 0.5], [1.0], [float("nan")], "0.5",
                                    [True]])
def test_bad_re_plan_shares_are_refused(shares):
    with pytest.raises(UsageError, match="increasing shares"):
        TimeBudget(1.0, replan_at=shares)


def test_a_re_plan_times_at_least_measure_steps():
    """The next share of a 494-step plan after a plan at step 359 is 370 (75 %), 11 steps on:
    too short a window; 444 (90 %) is the first at least 60 steps on."""
    budget = TimeBudget(6, skip_steps=40, measure_steps=60)
    budget.plans = [(100, 1436), (359, 494)]
    budget._start_window(359, now=0.0)
    assert budget._plan_at == 444
    budget.plans.append((444, 460))
    budget._start_window(444, now=0.0)
    assert budget._plan_at == -1  # 90 % of 460 is 414: no share left
