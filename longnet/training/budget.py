"""Train for a wall-clock budget: measure the step rate, plan the step count, re-plan it.

A fixed step count keeps no time promise across machines that differ 3x in speed; a budget
does. :class:`TimeBudget` times ``measure_steps`` optimizer steps early in the warmup, plans
the number of steps that fills the budget, and lays the learning-rate schedule over exactly
that many steps (the warmup does not depend on the length, so the run is the one a fixed
``max_steps`` of the planned count would give). A rate measured over a few dozen steps can be
that of a slow or fast patch of the machine (a neighbour's job, a validation), so the plan is
made again at fixed shares of itself from the rate since the last plan, the decay re-laid from
there with the learning rate continuous. Between those points the clock is read after every
step: a machine that slows down after a plan is planned for again as soon as its rate says the
plan would end late, and training stops at the first step that ends past the budget. The plans
are part of the checkpoint: a resumed run keeps them, so a run is deterministic given its plans.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from longnet.validation import UsageError, check_non_negative_int, check_positive_int, is_real

REPLAN_AT = (0.25, 0.5, 0.75, 0.9)
"""The shares of the plan at which :class:`TimeBudget` plans again, by default."""
LATE_SHARE = 0.05
"""How late (a share of the budget) the rate since the last plan may say a plan ends before
:class:`TimeBudget` plans again between its shares."""


class TimeBudget(L.Callback):
    """Plan ``max_steps`` so that training takes about ``training_minutes`` of wall-clock time.

    The rate is first measured over optimizer steps ``skip_steps .. skip_steps +
    measure_steps`` (the first steps are slower: on a 2-core CPU steps 10-70 ran at 2.0
    steps/s, later ones at 3.0); the plan is ``steps done + rate x time left``, capped by the
    trainer's ``max_steps``. Then, at each share of ``replan_at`` of the planned steps, the
    rate since the last plan gives a new plan and the learning-rate decay is re-laid from that
    step to the new end (``CausalLMModule.plan_schedule``). A first plan inside the warmup is
    exact: the learning rates are those of a fixed ``max_steps`` of its count; a re-plan at a
    steady rate plans the same count again. Training time starts at the first training step
    and is kept across resumes: the sanity check, data preparation, the final validation and
    test, and the time a run was stopped are not in the budget. One log line says each plan
    and why (a re-plan only when it changes the count); with several ranks, rank 0's plan is
    used by all.

    The clock is also read after every step between those shares, so a machine that slows
    down after the last plan cannot overrun the budget by minutes: once ``measure_steps`` steps
    are timed since the last plan, a rate that says the plan would end more than
    :data:`LATE_SHARE` of the budget late plans again at once; and training stops (the plan
    becomes the current step, with one log line) after the first step that ends past the
    budget, at most one step late.

    Resuming (``--ckpt_path last``) keeps the plans, also from a run stopped before its first
    plan (that plan is then made after the resume, from the steps timed then). A resumed run
    whose ``max_steps`` differs from the one planned under (``--trainer.max_steps N`` to extend
    a finished run) trains to ``N`` instead, with the schedule of a run of ``N`` steps, as a
    run without a budget would, and plans no more.

    Args:
        training_minutes: the budget for the training steps, in minutes.
        skip_steps: steps before the measurement starts.
        measure_steps: steps timed to measure the rate for the first plan.
        replan_at: shares (in (0, 1), increasing) of the planned steps at which to plan again;
            ``[]`` keeps the first plan.
    """

    def __init__(self, training_minutes: float, skip_steps: int = 40, measure_steps: int = 60,
                 replan_at: Sequence[float] = REPLAN_AT) -> None:
        self.budget_s = _budget_seconds(training_minutes)
        check_non_negative_int("skip_steps", skip_steps)
        check_positive_int("measure_steps", measure_steps)
        self.replan_at = _check_shares(replan_at)
        self.skip_steps = skip_steps
        self.measure_steps = measure_steps
        self.plans: list[tuple[int, int]] = []  # (step the plan was made at, planned steps)
        self.planned_under: int | None = None  # the trainer's max_steps when planned
        self.trained_s = 0.0  # training time before this fit (a resumed run's)
        self.extended = False  # max_steps was changed after the plan: no more plans
        self._train_start: float | None = None  # on the clock, less trained_s; None: not training
        self._window_start = 0.0
        self._window_from = self._plan_at = 0  # the steps timed for the next plan

    @property
    def planned_steps(self) -> int | None:
        """The steps planned last; None before the first plan."""
        return self.plans[-1][1] if self.plans else None

    def clock(self) -> float:
        """Seconds on a monotonic clock (the time the budget counts)."""
        return time.monotonic()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not hasattr(pl_module, "plan_schedule"):
            raise UsageError(
                f"TimeBudget needs a module whose learning-rate schedule it can plan "
                f"(plan_schedule(total_steps, from_step), as CausalLMModule has); "
                f"{type(pl_module).__name__} has none.")
        step, cap = trainer.global_step, trainer.max_steps
        self._train_start = self.clock() - self.trained_s
        if self.plans and self.planned_under != cap:
            rank_zero_info(
                f"Time budget: max_steps is now {cap:,} (the plan of {self.planned_steps:,} "
                f"steps was made under {self.planned_under:,}); training to {cap:,}.")
            self.plans, self.planned_under, self.extended = [(0, cap)], cap, True
        for from_step, steps in self.plans:
            pl_module.plan_schedule(steps, from_step)
        if self.plans:
            trainer.fit_loop.epoch_loop.max_steps = self.planned_steps
            if step:
                rank_zero_info(f"Time budget: resumed at step {step:,} of the plan's "
                               f"{self.planned_steps:,}.")
            self._start_window(step)
            return
        self._window_from = max(self.skip_steps, step)
        self._plan_at = self._window_from + self.measure_steps
        if 0 < cap <= self._plan_at:
            rank_zero_info(
                f"Time budget: not applied: max_steps {cap:,} ends the run before step "
                f"{self._plan_at:,}, where the budget would plan; training to {cap:,}.")
            self._plan_at = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not self.plans and trainer.global_step == self._window_from:
            self._window_start = self.clock()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.plans and (step >= self.planned_steps or self.extended):
            return
        if step != self._plan_at:
            if self.plans:
                self._check_clock(trainer, pl_module, step)
            return
        self._plan(trainer, pl_module, step, self.clock())

    def _check_clock(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """Between the plan points: stop after a step that ends past the budget; plan again
        when the rate since the last plan (over at least ``measure_steps`` steps) says the
        plan would end more than :data:`LATE_SHARE` of the budget late. Rank 0 decides."""
        now = self.clock()
        left = self.budget_s - (now - self._train_start)
        timed = step - self._window_from
        rate = timed / max(now - self._window_start, 1e-9)
        late = (self.planned_steps - step) / max(rate, 1e-9) - left
        verdict = 2 if left <= 0 else int(timed >= self.measure_steps
                                          and late > LATE_SHARE * self.budget_s)
        verdict = trainer.strategy.broadcast(verdict, src=0)
        if verdict == 2:
            rank_zero_info(
                f"Time budget: spent after step {step:,} of the plan's {self.planned_steps:,} "
                f"({rate:.2f} steps/s since step {self._window_from:,}, slower than planned); "
                "training stops here.")
            self.plans.append((step, step))
            trainer.fit_loop.epoch_loop.max_steps = step
        elif verdict == 1:
            self._plan(trainer, pl_module, step, now)

    def _plan(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int,
              now: float) -> None:
        """Plan the steps that fill the budget from the rate since ``_window_from``, lay the
        learning-rate decay over them and time the next window."""
        rate = (step - self._window_from) / max(now - self._window_start, 1e-9)
        left = self.budget_s - (now - self._train_start)
        wanted = step + max(1, math.floor(rate * left))
        cap = self.planned_under if self.plans else trainer.max_steps  # the plan sets the other
        planned = trainer.strategy.broadcast(min(wanted, cap) if cap > 0 else wanted, src=0)
        before, window = self.planned_steps, (self._window_from, step)
        self.plans.append((step, planned))
        self.planned_under = cap
        trainer.fit_loop.epoch_loop.max_steps = planned
        pl_module.plan_schedule(planned, step)
        self._start_window(step, now)
        capped = f" (capped by max_steps {cap:,})" if planned < wanted else ""
        if before is None:
            rank_zero_info(
                f"Time budget: {self.budget_s / 60:g} min of training at {rate:.2f} steps/s "
                f"(measured over steps {window[0]}-{window[1]}) -> {planned:,} steps{capped}; "
                "the learning rate decays over them.")
        elif planned != before:
            rank_zero_info(
                f"Time budget: re-planned at step {step:,}: {rate:.2f} steps/s over steps "
                f"{window[0]:,}-{window[1]:,}, {max(left, 0.0) / 60:.1f} min left -> "
                f"{planned:,} steps (was {before:,}){capped}.")

    def _start_window(self, step: int, now: float | None = None) -> None:
        """Time the steps from ``step`` for the next re-plan, at the next share of the plan at
        least ``measure_steps`` past ``step`` (a shorter window would time a patch; none
        left: never)."""
        self._window_from = step
        self._window_start = self.clock() if now is None else now
        shares = () if self.extended else self.replan_at
        points = [math.floor(share * self.planned_steps) for share in shares]
        self._plan_at = min((p for p in points if p >= step + self.measure_steps), default=-1)

    def state_dict(self) -> dict[str, Any]:
        trained = self.trained_s if self._train_start is None else self.clock() - self._train_start
        return {"plans": [list(plan) for plan in self.plans], "planned_under": self.planned_under,
                "trained_s": trained, "extended": self.extended,
                "planned_steps": self.planned_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        plans = state_dict.get("plans")
        if plans is None and state_dict.get("planned_steps") is not None:  # one plan only
            plans = [(0, state_dict["planned_steps"])]
        self.plans = [(int(step), int(steps)) for step, steps in plans or ()]
        self.planned_under = state_dict.get("planned_under")
        self.trained_s = float(state_dict.get("trained_s", 0.0))
        self.extended = bool(state_dict.get("extended", False))


class TrainingDeadline(L.Callback):
    """Stop training after the first optimizer step that ends past the wall-clock time ``at``
    (UNIX seconds, as ``time.time()`` gives them), as ``trainer.max_time`` stops it: the
    final validation, the test and the export still run.

    For a job whose whole wall clock is bounded, such as a device call with a timeout:
    ``at`` is its start plus its limit, less what must run after training. Whatever the
    steps before training took (imports, the data build), training then ends in time; a
    fixed ``max_time`` would have to assume the slowest start. With several ranks, rank 0's
    clock decides for all.
    """

    def __init__(self, at: float) -> None:
        if not is_real(at) or not math.isfinite(at) or at <= 0:
            raise UsageError(f"TrainingDeadline: at must be a time in UNIX seconds (as "
                             f"time.time() gives it, e.g. $(date +%s) + 480), got {at!r}.")
        self.at = float(at)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        late = trainer.strategy.broadcast(time.time() >= self.at)
        if late and not trainer.should_stop:
            clock = time.strftime("%H:%M:%S", time.localtime(self.at))
            rank_zero_info(f"TrainingDeadline: past {clock}, training stops after step "
                           f"{trainer.global_step}.")
            trainer.should_stop = True


def _budget_seconds(training_minutes: object) -> float:
    """``training_minutes`` in seconds; ``UsageError`` unless a positive number whose seconds
    are finite (``1e308`` minutes overflow)."""
    seconds = math.inf
    if is_real(training_minutes) and training_minutes > 0:
        with contextlib.suppress(OverflowError):  # an int past float's range
            seconds = 60.0 * float(training_minutes)
    if not math.isfinite(seconds):
        raise UsageError(
            f"TimeBudget(training_minutes=...) must be a positive number of minutes whose "
            f"seconds are a finite float, got {training_minutes!r}.")
    return seconds


def _check_shares(replan_at: object) -> tuple[float, ...]:
    """``replan_at`` as a tuple; ``UsageError`` unless increasing shares in (0, 1)."""
    shares = tuple(replan_at) if isinstance(replan_at, (list, tuple)) else None
    if shares is None or not all(is_real(s) and 0 < s < 1 for s in shares) \
            or any(a >= b for a, b in zip(shares, shares[1:])):
        raise UsageError(
            f"TimeBudget(replan_at=...) must be a list of increasing shares of the plan between "
            f"0 and 1 (e.g. [0.25, 0.5, 0.75]; [] never re-plans), got {replan_at!r}.")
    return shares
