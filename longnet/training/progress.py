"""Training progress counted in optimizer steps: a tqdm bar for terminals, plain lines otherwise.

Lightning's own bars count the batches of the current epoch against the *remaining* steps,
which reads "Epoch 0/-2" (rich, ``max_epochs=-1``) and "300/99" after a resume. Both bars here
show ``global_step`` of ``trainer.estimated_stepping_batches`` (``max_steps`` when it is set),
so a resumed run continues where it stopped: "step 300/400". ``progress_bar()`` picks one:
:class:`StepProgressBar` when stdout is a terminal, :class:`LineProgressBar` (no carriage
returns; one line every few percent) when it is a file or a pipe.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn


def total_steps(trainer: L.Trainer) -> float:
    """The optimizer steps the run will reach (``inf`` when unbounded)."""
    return float(trainer.estimated_stepping_batches)


def _without_version(metrics: dict[str, Any]) -> dict[str, Any]:
    metrics.pop("v_num", None)  # RunLogger has no version sub-folder
    return metrics


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar with the training bar counting optimizer steps: ``global_step`` of
    the run's total steps, also after a resume. Validation, test and predict bars are
    Lightning's."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)  # a resume inside an epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._count_steps(trainer)

    def _count_steps(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        total = total_steps(trainer)
        bar.reset(None if math.isinf(total) else int(total))
        bar.initial = bar.n = trainer.global_step  # the rate counts this run's steps only
        bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is None or bar.disable or bar.n == step:
            return
        total = total_steps(trainer)
        if math.isfinite(total) and bar.total != int(total):  # re-planned (TimeBudget)
            bar.total = int(total)
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes


class LineProgressBar(ProgressBar):
    """Progress as plain lines on stdout, for logs and pipes (no carriage returns): about
    ``lines`` lines per run, ``step N/T (P%)``, the progress-bar metrics, steps per second and
    the time left; one line per validation with its ``val/*`` metrics.

    Args:
        lines: how many progress lines a whole run prints (at most one per step).
    """

    def __init__(self, lines: int = 20) -> None:
        super().__init__()
        self.lines = lines
        self._enabled = True
        self._started = 0.0
        self._first_step = 0
        self._last_printed = -1

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started, self._first_step = time.monotonic(), trainer.global_step
        self._last_printed = trainer.global_step
        if self.is_enabled:
            total = total_steps(trainer)
            of = "" if math.isinf(total) else f" of {int(total)}"
            self.print(f"Training from step {trainer.global_step}{of}.", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step, total = trainer.global_step, total_steps(trainer)
        every = max(1, int(total) // self.lines) if math.isfinite(total) else 100
        if not self.is_enabled or step == self._last_printed:
            return
        if step % every == 0 or step == total:
            self._last_printed = step
            self.print(self._line(trainer, pl_module, step, total), flush=True)

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int,
              total: float) -> str:
        elapsed = time.monotonic() - self._started
        rate = (step - self._first_step) / elapsed if elapsed > 0 else 0.0
        parts = [f"step {step}" + ("" if math.isinf(total) else
                                   f"/{int(total)} ({100 * step / max(total, 1):.0f}%)")]
        metrics = _without_version(self.get_metrics(trainer, pl_module))
        parts += [f"{key} {_short(value)}" for key, value in metrics.items()]
        parts.append(f"{rate:.2f} steps/s")
        if rate > 0 and math.isfinite(total):
            parts.append(f"{_clock(elapsed)} elapsed, {_clock((total - step) / rate)} left")
        return "  ".join(parts)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.is_enabled or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        values = {key: value for key, value in trainer.callback_metrics.items()
                  if key.startswith("val/")}
        shown = "  ".join(f"{key} {_short(float(value))}" for key, value in values.items())
        self.print(f"validation at step {trainer.global_step}: {shown}", flush=True)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def progress_bar() -> ProgressBar:
    """:class:`StepProgressBar` when stdout is a terminal, else :class:`LineProgressBar`."""
    return StepProgressBar() if sys.stdout.isatty() else LineProgressBar()
