"""The optimizer and the one place that sets a run's learning rate: AdamW with a warmup-cosine
schedule whose decay can be re-laid while training (:func:`plan_schedule`), a wall-clock budget
or deadline, and a re-warmup after a resume with fresh moments (:class:`Rewarmup`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from longnet.nn.short_conv import CausalShortConv
from longnet.validation import UsageError, check_non_negative_int, check_positive_int, is_real

REPLAN_AT = (0.25, 0.5, 0.75, 0.9)
"""Default shares of the plan at which :class:`TimeBudget` plans again."""
LATE_SHARE = 0.05
"""Share of the budget a plan may be predicted late before :class:`TimeBudget` re-plans."""


def parameter_groups(model: nn.Module, weight_decay: float,
                     kv_conv_lr: float | None = None) -> list[dict]:
    """AdamW groups: decay on >= 2-dim parameters, none on vectors and K/V convolution taps
    (identity at init: decay would drop the keys), the taps at ``kv_conv_lr`` when given.

    Raises:
        ValueError: ``kv_conv_lr`` is given and no trainable convolution tap exists.
    """
    convolution_taps = {
        id(module.weight) for module in model.modules() if isinstance(module, CausalShortConv)
    }
    decay, no_decay, taps, seen = [], [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in convolution_taps:
            (no_decay if kv_conv_lr is None else taps).append(param)
        else:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if kv_conv_lr is None:
        return groups
    if not taps:
        raise ValueError(
            "kv_conv_learning_rate is set but the model has no trainable key/value convolution: "
            "set kv_conv_size in the model's config (and lora.train_kv_conv with LoRA), or "
            "leave kv_conv_learning_rate unset.")
    return [*groups, {"params": taps, "weight_decay": 0.0, "lr": kv_conv_lr}]


@dataclass
class WarmupCosine:
    """LR multiplier at 0-based optimizer ``step``: linear from ``1 / (warmup_steps + 1)`` to 1
    over ``warmup_steps``, then a cosine to ``min_lr_ratio`` at ``total_steps``, then constant.
    The decay can be re-laid while it runs: ``plans`` are ``(from_step, total_steps)`` pairs;
    from each ``from_step`` the cosine's progress goes on linearly to 1 at its ``total_steps``
    (the rate stays continuous)."""

    warmup_steps: int
    min_lr_ratio: float
    plans: tuple[tuple[int, int], ...]

    def relaid(self, total_steps: int, from_step: int) -> WarmupCosine:
        """The decay laid over ``total_steps`` from ``from_step`` (the count in force: no-op)."""
        kept = tuple(plan for plan in self.plans if plan[0] < from_step)
        if kept and kept[-1][1] == total_steps:
            return replace(self, plans=kept)
        return replace(self, plans=(*kept, (from_step, total_steps)))

    def progress(self, step: int) -> float:
        """The cosine's progress in [0, 1] at ``step`` (0 in the warmup)."""
        start, progress_at_start, total = self.warmup_steps, 0.0, self.plans[0][1]
        for from_step, next_total in self.plans[1:]:
            from_step = max(from_step, self.warmup_steps)
            if step < from_step:
                break
            start, progress_at_start, total = (
                from_step, _progress(from_step, start, progress_at_start, total), next_total)
        return _progress(step, start, progress_at_start, total)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        cosine = 1.0 + math.cos(math.pi * self.progress(step))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * cosine


def _progress(step: int, start: int, progress_at_start: float, total: int) -> float:
    """Progress at ``step``, linear from ``progress_at_start`` at ``start`` to 1 at ``total``."""
    share = (step - start) / max(1, total - start)
    return min(1.0, progress_at_start + (1.0 - progress_at_start) * share)


def build_optimizer(
    params: Iterable[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float,
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` (groups from :func:`parameter_groups`) and its per-step schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps)
    scheduler = LambdaLR(optimizer, WarmupCosine(warmup_steps, min_lr_ratio, ((0, total_steps),)))
    return optimizer, scheduler


def check_optimizer_settings(lr: float, weight_decay: float, betas: Sequence[float],
                             eps: float, warmup_steps: int, total_steps: int | None,
                             min_lr_ratio: float) -> None:
    """Raise ValueError for AdamW or schedule settings out of range."""
    if not lr > 0:
        raise ValueError(f"learning_rate must be positive, got {lr!r}.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}.")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}.")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}.")
    check_non_negative_int("warmup_steps", warmup_steps)
    if total_steps is not None:
        check_positive_int("total_steps", total_steps)
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}.")


def plan_schedule(scheduler: LambdaLR, total_steps: int, from_step: int = 0) -> None:
    """Lay ``scheduler``'s decay over ``total_steps`` from ``from_step`` on (``relaid``)."""
    check_positive_int("total_steps", total_steps)
    check_non_negative_int("from_step", from_step)
    schedule = scheduler.lr_lambdas[0].relaid(total_steps, from_step)
    scheduler.lr_lambdas = [schedule] * len(scheduler.optimizer.param_groups)
    scheduler.last_epoch -= 1  # recompute the pending step's rate from the new schedule
    scheduler.step()


def follow_configured_length(trainer: L.Trainer, scheduler: LambdaLR, total_steps: int,
                             learning_rate: float) -> None:
    """A resumed fit with another ``total_steps`` than its checkpoint's schedule takes that of
    a run of the new length (a warm restart); not under a :class:`TimeBudget`."""
    if any(isinstance(callback, TimeBudget) for callback in trainer.callbacks):
        return
    schedule = scheduler.lr_lambdas[0]
    if [tuple(plan) for plan in schedule.plans] == [(0, total_steps)]:
        return
    step, before = trainer.global_step, schedule(trainer.global_step)
    plan_schedule(scheduler, total_steps)
    rank_zero_info(
        f"Resumed at step {step:,} with a learning-rate schedule of "
        f"{schedule.plans[-1][1]:,} steps (the checkpoint's); it is now that of "
        f"{total_steps:,} steps, as configured: the rate at step {step:,} goes from "
        f"{before * learning_rate:.3g} to {scheduler.lr_lambdas[0](step) * learning_rate:.3g}.")


class Rewarmup(L.Callback):
    """Ramp the learning rate back up after a resume at step ``S`` with empty optimizer state
    (a weights-only checkpoint): the rate times ``(k + 1) / (steps + 1)`` at step ``S + k``.

    Args:
        steps: optimizer steps of the ramp; 0 turns it off.
    """

    def __init__(self, steps: int = 100) -> None:
        self.steps = check_non_negative_int("steps", steps)
        self.start: int | None = None

    def factor(self, step: int) -> float:
        """The multiplier of the scheduled learning rate at optimizer step ``step``."""
        if self.start is None or not self.start <= step < self.start + self.steps:
            return 1.0
        return (step - self.start + 1) / (self.steps + 1)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and not any(opt.state for opt in trainer.optimizers):
            self.start = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        factor = self.factor(trainer.global_step)
        if factor == 1.0:
            return
        # from the scheduler's rate, which its next step recomputes: nothing accumulates
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, rate in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = rate * factor

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.start = state_dict.get("start")


class TimeBudget(L.Callback):
    """Plan ``max_steps`` so that training takes about ``training_minutes`` of wall-clock time.

    The plan is ``steps done + rate x time left`` (capped by ``max_steps``; rate measured
    after ``skip_steps``), the decay laid over it; it is re-made at each ``replan_at`` share,
    or at once when running :data:`LATE_SHARE` late, and training stops past the budget. Only
    training steps count, across resumes; rank 0's clock decides.

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
        self._scheduler: LambdaLR | None = None

    @property
    def planned_steps(self) -> int | None:
        """The steps planned last; None before the first plan."""
        return self.plans[-1][1] if self.plans else None

    def clock(self) -> float:
        """Seconds on a monotonic clock (the time the budget counts)."""
        return time.monotonic()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scheduler = pl_module.lr_schedulers()
        if not isinstance(getattr(scheduler, "lr_lambdas", [None])[0], WarmupCosine):
            raise UsageError(
                f"TimeBudget needs a module whose learning-rate schedule it can plan (a "
                f"WarmupCosine, as CausalLMModule configures); {type(pl_module).__name__} has "
                "none.")
        self._scheduler = scheduler
        step, cap = trainer.global_step, trainer.max_steps
        self._train_start = self.clock() - self.trained_s
        if self.plans and self.planned_under != cap:
            rank_zero_info(
                f"Time budget: max_steps is now {cap:,} (the plan of {self.planned_steps:,} "
                f"steps was made under {self.planned_under:,}); training to {cap:,}.")
            self.plans, self.planned_under, self.extended = [(0, cap)], cap, True
        for from_step, steps in self.plans:
            plan_schedule(scheduler, steps, from_step)
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
        """Between plan points: stop past the budget, or re-plan when running late."""
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
        """Plan the steps that fill the budget from the rate since ``_window_from``."""
        rate = (step - self._window_from) / max(now - self._window_start, 1e-9)
        left = self.budget_s - (now - self._train_start)
        wanted = step + max(1, math.floor(rate * left))
        cap = self.planned_under if self.plans else trainer.max_steps  # the plan sets the other
        planned = trainer.strategy.broadcast(min(wanted, cap) if cap > 0 else wanted, src=0)
        before, window = self.planned_steps, (self._window_from, step)
        self.plans.append((step, planned))
        self.planned_under = cap
        trainer.fit_loop.epoch_loop.max_steps = planned
        plan_schedule(self._scheduler, planned, step)
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
        """Time from ``step`` to the next plan share at least ``measure_steps`` away."""
        self._window_from = step
        self._window_start = self.clock() if now is None else now
        shares = () if self.extended else self.replan_at
        points = [math.floor(share * self.planned_steps) for share in shares]
        self._plan_at = min((p for p in points if p >= step + self.measure_steps), default=-1)

    def state_dict(self) -> dict[str, Any]:
        trained = self.trained_s if self._train_start is None else self.clock() - self._train_start
        return {"plans": [list(plan) for plan in self.plans], "planned_under": self.planned_under,
                "trained_s": trained, "extended": self.extended}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.plans = [(int(step), int(steps)) for step, steps in state_dict.get("plans") or ()]
        self.planned_under = state_dict.get("planned_under")
        self.trained_s = float(state_dict.get("trained_s", 0.0))
        self.extended = bool(state_dict.get("extended", False))


class TrainingDeadline(L.Callback):
    """Stop training (not the final validation, test, export) after the first optimizer step
    ending past ``at`` (UNIX seconds): unlike ``max_time``, the time before training counts."""

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
    """``training_minutes`` in seconds; ``UsageError`` unless positive with finite seconds."""
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
