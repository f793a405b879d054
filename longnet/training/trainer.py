"""The trainer the ``longnet`` command runs: ``precision: auto`` is ``bf16-mixed`` only where
bfloat16 matrices multiply natively (:class:`AutoPrecisionTrainer`); SIGTERM / SIGINT stop it
at a consistent point, status ``128 + signal`` (:class:`StopOnSignal`; Lightning exits 0)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from longnet.training.callbacks import LastCheckpoint, validation_follows

AUTO = "auto"
CPU_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}
"""``/proc/cpuinfo`` flags of bfloat16 matrix units, and their names."""
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo``; empty where there are none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def auto_precision(device: Literal["cpu", "cuda"], flags: set[str] | None = None
                   ) -> tuple[str, str]:
    """``("bf16-mixed" or "32-true", reason)``: what ``auto`` means on ``device``.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (the current CUDA device).
        flags: the CPU's flags; None reads them (:func:`cpu_flags`).
    """
    if device == "cuda":
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"the GPU {name} supports bfloat16"
        return "32-true", f"the GPU {name} does not support bfloat16"
    units = [name for flag, name in CPU_BF16_FLAGS.items()
             if flag in (cpu_flags() if flags is None else flags)]
    if units:
        return "bf16-mixed", f"this CPU has bfloat16 matrix units ({', '.join(units)})"
    return "32-true", ("this CPU has no bfloat16 matrix units (no AMX, no AVX512-BF16), where "
                       "bf16-mixed autocast is slower than float32")


def _device(accelerator: str | Accelerator) -> Literal["cpu", "cuda"] | None:
    """The device kind ``accelerator`` resolves to (None: another kind, e.g. ``mps``)."""
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    if accelerator in ("cpu", "auto"):
        return "cpu"
    return None


def resolve_precision(precision: Any, accelerator: str | Accelerator) -> Any:
    """``precision``, ``"auto"`` resolved by :func:`auto_precision` (logged with the reason).

    Raises:
        ValueError: ``"auto"`` with an accelerator other than CPU or CUDA.
    """
    if precision != AUTO:
        return precision
    device = _device(accelerator)
    if device is None:
        raise ValueError(
            f"precision 'auto' chooses for CPU and CUDA devices only, not accelerator "
            f"{accelerator!r}; set trainer.precision (e.g. 32-true)."
        )
    chosen, reason = auto_precision(device)
    rank_zero_info(f"Precision: {chosen} (auto: {reason}).")
    return chosen


class AutoPrecisionTrainer(L.Trainer):
    """Lightning's ``Trainer`` whose ``precision`` may also be ``"auto"``."""

    def __init__(self, *args: Any, accelerator: str | Accelerator = "auto",
                 precision: _PRECISION_INPUT | Literal["auto"] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, accelerator=accelerator,
                         precision=resolve_precision(precision, accelerator), **kwargs)


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
    """A signal outside a trainer's run (a ``BaseException``: ``except Exception`` misses it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum = signum


@contextmanager
def raising_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT raise :class:`Interrupted` (main thread)."""

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
    """Stop a run on SIGTERM or SIGINT at a consistent point, status ``128 + signal``: in
    ``fit``'s training all ranks agree each step and stop after its due validation with
    ``last.ckpt``; elsewhere at the next batch; a second SIGINT stops at once.

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

    def _install(self, trainer: L.Trainer) -> None:
        """Our handler for both signals, replacing Lightning's (restored when the run ends)."""
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

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    on_validation_start = on_test_start = on_predict_start = on_sanity_check_start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        self._install(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False

    def _agree(self, trainer: L.Trainer) -> bool:
        """Whether any rank received a signal (collective; the largest number wins)."""
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
        """A stop by a signal: ``last.ckpt`` (in training), a resume hint, status ``128 + sig``."""
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
    """``last.ckpt`` saved now by the first :class:`LastCheckpoint` (collective); None without."""
    callback = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)),
                    None)
    return None if callback is None else callback.save_now(trainer)
