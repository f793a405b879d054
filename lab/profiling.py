"""What one training step costs on the machine a run trains on, measured inside the run.

:class:`StepProfiler` records a few consecutive training steps with ``torch.profiler`` once
the run has warmed up, and writes ``<run folder>/profile.txt``: the wall time of a step (the
device synchronized at both ends of the window), the summed time of the device's kernels in
it, how many kernels and host-side ATen ops one step launches, the batches the steps trained
on (rows x tokens, documents per row), the device memory's peak in the window, and the ops
that take the most device and host time. Kernel time far below the wall time means the step
waits on the host (Python and op dispatch, kernel launches, synchronizations), not on the
device's math.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from longnet.training.run_folder import run_dir
from longnet.validation import check_non_negative_int, check_positive_int


class StepProfiler(L.Callback):
    """Profile ``steps`` training steps, starting ``start`` steps after this fit began, and
    write the report to ``<run folder>/<filename>`` (rank 0; every rank profiles its own
    steps, rank 0 reports).

    ``start`` counts from where the fit began (a resumed run: from its restored step), so the
    first steps' one-off costs (allocator growth, kernel selection, the data loader's
    workers starting) stay out of the window. A fit that ends before the window closes writes
    what it recorded; one that ends before it opens writes nothing and says so. The profile
    is a measurement beside the training: a profiler that fails to start or to write is a
    warning, never the end of the run. ``row_limit``: rows of each table of operations.

    The report names each profiled batch's shape and, with packed documents, how many
    documents each row held (the attention's kernel calls grow with them), as the batch
    reaches this callback: list it after a :class:`~longnet.training.LengthCurriculum`,
    which cuts the batch in place.
    """

    def __init__(self, start: int = 20, steps: int = 3, filename: str = "profile.txt",
                 row_limit: int = 25) -> None:
        self.start = check_non_negative_int("StepProfiler: start", start)
        self.steps = check_positive_int("StepProfiler: steps", steps)
        self.row_limit = check_positive_int("StepProfiler: row_limit", row_limit)
        self.filename = filename
        self._first_step: int | None = None
        self._window: tuple[int, float] | None = None  # (first profiled step, start time)
        self._profile: profile | None = None
        self._path: Path | None = None
        self._batches: list[tuple[tuple[int, ...], Tensor | None]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step
        self._path = run_dir(trainer) / self.filename  # on every rank: log_dir is a collective

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        done = trainer.global_step - self._first_step
        if self._profile is None and self._window is None and done == self.start:
            self._begin(trainer, pl_module)
        elif self._profile is not None and done == self.start + self.steps:
            self._finish(trainer, pl_module)
        if self._profile is not None:
            self._batches.append(batch_layout(batch))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profile is not None:
            self._finish(trainer, pl_module)
        elif self._window is None:
            done = trainer.global_step - self._first_step
            rank_zero_info(f"StepProfiler: the fit ended after {done} steps, before the "
                           f"profile's first step ({self.start}); nothing was profiled.")

    def _begin(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        activities = [ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        _synchronize(pl_module.device)
        self._window = (trainer.global_step, time.perf_counter())
        try:
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._profile = profile(activities=activities)
            self._profile.start()
        except Exception as error:  # noqa: BLE001 - the profile must not end the training
            self._profile = None
            rank_zero_warn(f"StepProfiler: the profiler did not start ({type(error).__name__}: "
                           f"{error}); the training goes on unprofiled.")

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _synchronize(pl_module.device)
        first, started = self._window
        seconds = time.perf_counter() - started
        steps = trainer.global_step - first
        recorded, self._profile = self._profile, None
        try:
            recorded.stop()
            if trainer.is_global_zero and steps > 0:
                report = step_report(recorded.key_averages(), steps, seconds, first,
                                     _device_name(pl_module.device), self.row_limit,
                                     describe_batches(self._batches),
                                     _device_memory(pl_module.device))
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._path.write_text(report)
                rank_zero_info(f"StepProfiler: {steps} step(s) from step {first} profiled, "
                               f"{seconds / steps:.3f} s a step: {self._path}")
        except Exception as error:  # noqa: BLE001 - the profile must not end the training
            rank_zero_warn(f"StepProfiler: no profile written ({type(error).__name__}: "
                           f"{error}); the training goes on.")


def batch_layout(batch: Any) -> tuple[tuple[int, ...], Tensor | None]:
    """A training batch's ``input_ids`` shape and, with ``document_ids`` ``(rows, tokens)``,
    the number of documents of each row, ``(rows,)`` on the batch's device (not read here:
    reading it would wait for the device inside the profiled window; counting them adds three
    small kernels to the step). ``((), None)`` for a batch without ``input_ids``."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        return (), None
    ids = batch.get("document_ids")
    documents = None
    if isinstance(ids, Tensor) and ids.dim() == 2:
        documents = 1 + (ids[:, 1:] != ids[:, :-1]).sum(dim=1)
    return tuple(batch["input_ids"].shape), documents


def describe_batches(batches: list[tuple[tuple[int, ...], Tensor | None]]) -> list[str]:
    """One line per profiled batch: ``rows x tokens``, and the documents of each row."""
    lines = []
    for shape, documents in batches:
        size = " x ".join(f"{n:,}" for n in shape) or "no input_ids"
        lines.append(size if documents is None else
                     f"{size}, documents per row {documents.tolist()}")
    return lines


def step_report(events: Any, steps: int, seconds: float, first_step: int, device: str,
                row_limit: int, batches: list[str] | None = None,
                memory: tuple[int, int] | None = None) -> str:
    """The text of ``profile.txt`` from ``events`` (``profile.key_averages()``) of ``steps``
    steps from ``first_step`` on that took ``seconds`` of wall time on ``device``; ``batches``:
    a line for each step's batch (:func:`describe_batches`); ``memory``: the peak bytes the
    device's allocator held in the window and the device's total (None: not a GPU)."""
    kernels = [e for e in events if e.device_type != DeviceType.CPU]
    kernel_seconds = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    host_ops = sum(e.count for e in events
                   if e.device_type == DeviceType.CPU and e.key.startswith("aten::"))
    wall = seconds / steps
    window = (f"step {first_step}" if steps == 1 else
              f"steps {first_step}-{first_step + steps - 1} ({steps} steps)")
    lines = [
        f"Profile of training {window} on {device}, torch {torch.__version__}",
        f"wall time per step:            {wall:.4f} s (the device synchronized at both ends; "
        "the profiler's own cost included)",
    ]
    if kernels:
        lines += [
            f"device kernel time per step:   {kernel_seconds / steps:.4f} s "
            f"({100 * kernel_seconds / seconds:.1f} % of the wall time; kernels summed)",
            f"device kernels per step:       {launches / steps:,.0f}",
        ]
    lines += [f"host ATen ops per step:        {host_ops / steps:,.0f} (nested ones included)"]
    if memory is not None:
        peak, total = memory
        lines += [f"device memory peak:            {peak / 2**30:.1f} GiB of "
                  f"{total / 2**30:.1f} GiB ({100 * peak / total:.0f} %; tensors allocated in "
                  "the window)"]
    lines += [f"{f'batch of step {first_step + i}:':<31}{line}"
              for i, line in enumerate(batches or [])]
    lines += [""]
    if kernels:
        lines += ["By device time (self):",
                  events.table(sort_by="self_device_time_total", row_limit=row_limit), ""]
    lines += ["By host time (self):",
              events.table(sort_by="self_cpu_time_total", row_limit=row_limit)]
    return "\n".join(lines) + "\n"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """The allocator's peak bytes since the window began and the device's total bytes."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device),
            torch.cuda.get_device_properties(device).total_memory)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
