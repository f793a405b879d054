"""Train for a wall-clock budget: measure the step rate, plan the step count, keep the plan.

A fixed step count keeps no time promise across machines that differ 3x in speed; a budget
does. :class:`TimeBudget` times ``measure_steps`` optimizer steps early in the warmup, plans
the number of steps that fills the budget, and lays the learning-rate schedule over exactly
that many steps (the warmup does not depend on the length, so the run is the one a fixed
``max_steps`` of the planned count would give). The plan is part of the checkpoint: a resumed
run keeps it, so a run is deterministic given its plan.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from longnet.validation import UsageError, check_non_negative_int, check_positive_int, is_real


class TimeBudget(L.Callback):
    """Plan ``max_steps`` so that training takes about ``training_minutes`` of wall-clock time.

    The rate is measured over optimizer steps ``skip_steps .. skip_steps + measure_steps``
    (the first steps are slower: on a 2-core CPU steps 10-70 ran at 2.0 steps/s, later ones
    at 3.0), which must end inside the module's warmup; the plan is ``steps done + rate x
    time left``, capped by the trainer's ``max_steps``. Training time starts at the first
    training step: the sanity check, data preparation and the final validation and test are
    not in the budget. One log line says
    what was planned and why; with several ranks, rank 0's plan is used by all.

    Resuming (``--ckpt_path last``) keeps the plan. A resumed run whose ``max_steps`` differs
    from the one planned under (``--trainer.max_steps N`` to extend a finished run) trains to
    ``N`` instead, as a run without a budget would.

    Args:
        training_minutes: the budget for the training steps, in minutes.
        skip_steps: steps before the measurement starts.
        measure_steps: steps timed to measure the rate.
    """

    def __init__(self, training_minutes: float, skip_steps: int = 40,
                 measure_steps: int = 60) -> None:
        if not is_real(training_minutes) or not math.isfinite(training_minutes) \
                or training_minutes <= 0:
            raise UsageError(
                f"TimeBudget(training_minutes=...) must be a positive number of minutes, got "
                f"{training_minutes!r}.")
        check_non_negative_int("skip_steps", skip_steps)
        check_positive_int("measure_steps", measure_steps)
        self.budget_s = 60.0 * float(training_minutes)
        self.skip_steps = skip_steps
        self.measure_steps = measure_steps
        self.planned_steps: int | None = None
        self.planned_under: int | None = None  # the trainer's max_steps when the plan was made
        self._train_start = self._measure_start = 0.0
        self._measure_from = self._plan_at = 0  # the steps timed (set when training starts)

    def clock(self) -> float:
        """Seconds on a monotonic clock (the time the budget counts)."""
        return time.monotonic()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not hasattr(pl_module, "plan_schedule"):
            raise UsageError(
                f"TimeBudget needs a module whose learning-rate schedule it can plan "
                f"(plan_schedule(total_steps), as CausalLMModule has); "
                f"{type(pl_module).__name__} has none.")
        step, cap = trainer.global_step, trainer.max_steps
        if self.planned_steps is not None and self.planned_under != cap:
            rank_zero_info(
                f"Time budget: max_steps is now {cap:,} (the plan of {self.planned_steps:,} "
                f"steps was made under {self.planned_under:,}); training to {cap:,}.")
            self.planned_steps = self.planned_under = cap
        if self.planned_steps is not None:
            self._apply(trainer, pl_module, self.planned_steps)
            if step:
                rank_zero_info(f"Time budget: resumed at step {step:,} of the plan's "
                               f"{self.planned_steps:,}.")
            return
        self._measure_from = max(self.skip_steps, step)
        self._plan_at = max(self.skip_steps + self.measure_steps, step + self.measure_steps)
        warmup = pl_module.hparams.get("warmup_steps", 0)
        if self._plan_at > warmup:
            raise UsageError(
                f"TimeBudget would plan after step {self._plan_at:,}, past the warmup's "
                f"{warmup} steps: the learning rates before the plan would differ from those "
                "of the planned run. Lower skip_steps/measure_steps or raise "
                "--model.init_args.warmup_steps.")
        self._train_start = self.clock()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.planned_steps is None and trainer.global_step == self._measure_from:
            self._measure_start = self.clock()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.planned_steps is not None or trainer.global_step != self._plan_at:
            return
        now = self.clock()
        rate = (self._plan_at - self._measure_from) / (now - self._measure_start)
        left = self.budget_s - (now - self._train_start)
        wanted = trainer.global_step + max(1, math.floor(rate * left))
        cap = trainer.max_steps
        planned = trainer.strategy.broadcast(min(wanted, cap) if cap > 0 else wanted, src=0)
        self.planned_under = cap
        self._apply(trainer, pl_module, planned)
        rank_zero_info(
            f"Time budget: {self.budget_s / 60:g} min of training at {rate:.2f} steps/s "
            f"(measured over steps {self._measure_from}-{self._plan_at}) -> {planned:,} steps"
            + (f" (capped by max_steps {cap:,})" if planned < wanted else "")
            + "; the learning rate decays over them.")

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule, steps: int) -> None:
        self.planned_steps = steps
        trainer.fit_loop.epoch_loop.max_steps = steps
        pl_module.plan_schedule(steps)

    def state_dict(self) -> dict[str, Any]:
        return {"planned_steps": self.planned_steps, "planned_under": self.planned_under}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.planned_steps = state_dict.get("planned_steps")
        self.planned_under = state_dict.get("planned_under")
