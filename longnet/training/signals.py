"""SIGTERM and SIGINT: stop at the end of a step with a checkpoint, exit 143 / 130, say how to
resume.

Lightning notes SIGTERM in ``trainer.received_sigterm`` and its loops then raise
``SIGTERMException``, a ``SystemExit`` whose status is 0: a scheduler that stopped a run
sees success, nothing is saved, and SIGINT (Ctrl-C) interrupts a step anywhere
(``KeyboardInterrupt``), where no consistent checkpoint can be taken. Under several ranks
the flag is rank 0's alone: a rank that received the signal stops after its step while the
others wait for it in their next collective.

:class:`StopOnSignal` (the ``longnet`` command adds it to every trainer) handles both signals
while a trainer runs:

- during the training of ``fit``, a signal only notes its number. At the end of every
  training step and of every validation, all ranks agree on whether any of them received one
  (one small all-reduce, only with several ranks); if so every rank stops there, after the
  validation due at that step if there is one (so the run is consistent at that step:
  resuming redoes nothing and skips nothing), through Lightning's own flag and
  ``SIGTERMException``. ``LastCheckpoint`` then writes ``last.ckpt`` on every rank
  (:meth:`StopOnSignal.on_exception`), one line says where and how to resume
  (``--ckpt_path last``), and the exit status is ``128 + signal``: 143 for SIGTERM, 130 for
  SIGINT;
- outside training (the sanity check, ``validate``, ``test``, ``predict``), Lightning's
  evaluation loops stop at their next batch; the same status, no checkpoint (nothing was
  trained since the last one), one line saying to run the command again. Under several ranks
  only the ranks that received the signal stop there; the others stop at their next
  collective, naming them
  (:class:`~longnet.distributed.watch.RankWatch`);
- a second SIGINT stops the process at once (the default action of the signal).

Outside a trainer's run (building the data, the model, the export), the ``longnet`` command's
:func:`raising_on_signals` makes either signal raise :class:`Interrupted` at once (exit
status 143 / 130, one line).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from longnet.training.callbacks import LastCheckpoint, validation_follows

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RESUME_HINT = "Run the same command with --ckpt_path last to continue from the last checkpoint."
RERUN_HINT = ("Nothing was saved since the last checkpoint: run the command again (a fit with "
              "--ckpt_path last continues from its last checkpoint).")
"""What to do after a stop outside the training of a fit (nothing to resume from there)."""


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by signal ``signum``: ``128 + signum``."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGINT``, ..."""
    return signal.Signals(signum).name


class Interrupted(BaseException):
    """A signal outside a trainer's run (:func:`raising_on_signals`); a ``BaseException``, as
    ``KeyboardInterrupt``, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum = signum


@contextmanager
def raising_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT raise :class:`Interrupted` (in the main thread,
    where signals are handled); the previous handlers come back when it ends. A trainer's run
    replaces these with :class:`StopOnSignal`'s and Lightning restores them after it."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopOnSignal(L.Callback):
    """Stop a run on SIGTERM or SIGINT at a consistent point, with a checkpoint and exit
    status ``128 + signal`` (module docstring).

    Attributes:
        signum: the signal that stops the run (agreed by all ranks during training), None
            while there is none.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._received: int | None = None  # by this process
        self._training = False
        self._stop_after_validation = False
        self._agreed = False  # every rank stops at the same point
        self._trainer: L.Trainer | None = None

    # ------------------------------------------------------------------ the handlers
    def _install(self, trainer: L.Trainer) -> None:
        """Our handler for both signals, replacing Lightning's SIGTERM one (registered when the
        run started; Lightning puts the previous handlers back when it ends)."""
        self._trainer = trainer
        if signal.getsignal(signal.SIGTERM) != self._on_signal:
            for signum in SIGNALS:
                signal.signal(signum, self._on_signal)
        if self.signum is not None and not self._training:
            self._stop(trainer)  # received between two runs of the trainer (fit, then test)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._received == signal.SIGINT and signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)  # the second Ctrl-C: stop now
            os.kill(os.getpid(), signum)
            return
        if self._received is not None:
            return
        self._received = signum
        trainer = self._trainer
        when = "at the end of this step" if self._training else "now"
        print(f"longnet: received {signal_name(signum)}: stopping {when}"
              + (" with a checkpoint" if self._training else "") + ".", file=sys.stderr,
              flush=True)
        if not self._training and trainer is not None:
            self.signum = signum
            self._stop(trainer)

    @staticmethod
    def _stop(trainer: L.Trainer) -> None:
        """Lightning's flag: its loops raise ``SIGTERMException`` at their next check."""
        trainer._signal_connector.received_sigterm = True

    # ------------------------------------------------------------------ Lightning hooks
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        self._install(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def _agree(self, trainer: L.Trainer) -> bool:
        """Whether any rank received a signal (every rank calls it at the same point; the
        largest signal number wins); sets :attr:`signum`."""
        agreed = self._received or 0
        if trainer.world_size > 1:
            received = torch.tensor(agreed, device=trainer.strategy.root_device)
            agreed = int(trainer.strategy.reduce(received, reduce_op="max").item())
        if agreed:
            self.signum, self._agreed = agreed, True
        return bool(agreed)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: object, batch: object, batch_idx: int) -> None:
        if not self._agree(trainer):
            return
        if validation_follows(trainer):
            self._stop_after_validation = True
        else:
            self._stop(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a validation of ``fit``: stop if a signal came before it or during it."""
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and (
                self._stop_after_validation or self._agree(trainer)):
            self._stop(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        """A stop by a signal: ``last.ckpt`` (during training), the line saying how to resume,
        and the exit status ``128 + signal`` (on every rank)."""
        self._training = False
        if not isinstance(exception, SIGTERMException) or self.signum is None:
            return
        name = signal_name(self.signum)
        by = "" if self._received == self.signum else " (received by another rank)"
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            saved = save_last(trainer)
            of = f" of {trainer.max_steps}" if trainer.max_steps > 0 else ""
            where = (f"saved {saved}" if saved else
                     "no checkpoint saved (the trainer has no LastCheckpoint callback)")
            message = (f"stopped by {name}{by} after step {trainer.global_step}{of}; {where}. "
                       f"{RESUME_HINT if saved else ''}")
        else:
            stage = trainer.state.fn.value if trainer.state.fn else "the run"
            message = f"stopped by {name}{by} during {stage}. {RERUN_HINT}"
        prefix = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
        print(f"longnet: {prefix}{message.strip()}", file=sys.stderr, flush=True)
        exception.code = exit_status(self.signum)
        exception.every_rank = self._agreed  # for the strategies: no rank is lost


def save_last(trainer: L.Trainer) -> Path | None:
    """``last.ckpt`` saved now by the trainer's first :class:`LastCheckpoint` (a collective:
    call it on every rank); None without one."""
    callback = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)),
                    None)
    return None if callback is None else callback.save_now(trainer)
