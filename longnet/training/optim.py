"""AdamW with decoupled weight decay on matrices only, a linear-warmup cosine schedule, and a
re-warmup after a resume with fresh optimizer moments (:class:`Rewarmup`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from longnet.nn.short_conv import CausalShortConv
from longnet.validation import check_non_negative_int


def parameter_groups(model: nn.Module, weight_decay: float,
                     kv_conv_lr: float | None = None) -> list[dict]:
    """AdamW groups: weight decay on parameters with >= 2 dims (linear weights, embeddings),
    none on vectors (biases, norm scales) and on the K/V convolutions' per-channel taps (they
    start as the identity; decay would pull them towards dropping the keys). With
    ``kv_conv_lr`` the taps are a third group with that peak learning rate (the schedule
    scales it as it scales the others). Tied parameters appear once.

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


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based).

    Linear from ``1 / (warmup_steps + 1)`` up to 1 over ``warmup_steps`` steps, then a cosine
    from 1 down to ``min_lr_ratio`` at ``total_steps``; constant ``min_lr_ratio`` after that.
    """
    return WarmupCosine(warmup_steps, min_lr_ratio, ((0, total_steps),))(step)


@dataclass
class WarmupCosine:
    """:func:`warmup_cosine` whose decay can be re-laid while it runs (a time budget's plans).

    ``plans`` are ``(from_step, total_steps)`` pairs with increasing ``from_step``: from
    ``max(from_step, warmup_steps)`` on, the cosine's progress goes on from where the plan
    before left it, linearly to 1 at ``total_steps``, so the rate is continuous where a plan
    starts. A plan that starts in the warmup is the schedule of its ``total_steps`` from the
    start; the first plan's ``from_step`` is not read.
    """

    warmup_steps: int
    min_lr_ratio: float
    plans: tuple[tuple[int, int], ...]

    def relaid(self, total_steps: int, from_step: int) -> WarmupCosine:
        """This schedule with its decay laid over ``total_steps`` from ``from_step`` on; plans
        starting at or after ``from_step`` are replaced, and a plan of the count already in
        force changes nothing (the same rates, bit for bit)."""
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
    """Progress at ``step`` of a plan that goes from ``progress_at_start`` at ``start`` to 1 at
    ``total`` (at least one step later)."""
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


class Rewarmup(L.Callback):
    """Ramp the learning rate back up after a resume with fresh optimizer moments.

    A fit that starts at step ``S > 0`` with optimizers that hold no state (for example a
    checkpoint made from weights alone: the weights and the schedule's position, no AdamW moments)
    would take its first steps at the scheduled rate with moments built from one gradient,
    a large update. For the ``steps`` optimizer steps from ``S`` this callback multiplies
    the rate its schedulers give by ``(k + 1) / (steps + 1)`` at step ``S + k``, as the
    module's own warmup does from step 0. Any other start (step 0, a full checkpoint) is left
    alone. ``S`` is kept in checkpoints, so a run stopped during the ramp resumes it exactly.

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
