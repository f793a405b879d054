"""Each rank's measured peak memory while it trains (the planner's counterpart:
``lab.memory`` and ``lab/scripts/plan_context.py`` predict, this measures).

On CUDA the number is the caching allocator's peak (``torch.cuda.max_memory_allocated``); on
CPU it is the process's peak resident set, ``VmHWM`` of ``/proc/self/status``, reset when
training starts (``/proc/self/clear_refs``, Linux >= 4.0). Both are read as *above the start*:
the bytes the training step adds to what the process held when ``fit`` began training
(parameters, the wrapped model, data loaders and, on CPU, the Python process itself).

On CPU, glibc keeps freed buffers smaller than its adaptive mmap threshold (up to 32 MiB) in
the process, so the resident peak can exceed the peak of live tensors. For the live peak, run
with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed buffers above 128 KiB leave the resident set at
once); ``memory.json`` records whether it was set.
"""

from __future__ import annotations

import json
import os

import lightning as L
import torch

from longnet.training.callbacks import run_dir

MIB = 2**20
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
MALLOC_FIXED = {MMAP_THRESHOLD: "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc settings under which freed buffers above 128 KiB leave the RSS at once, so that the
peak RSS is the peak of live bytes (glibc's default adapts its threshold up to 32 MiB and keeps
freed buffers below it). The benchmarks start their measuring processes under them."""


def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``: now, ``VmHWM``: peak) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class RankMemory(L.Callback):
    """Write every rank's peak memory during ``fit`` to ``<run folder>/memory.json``.

    ``{"device", "step", "peak_since", "malloc_mmap_threshold", "ranks": [{"rank",
    "start_mib", "peak_mib", "peak_above_start_mib"}, ...]}``: ``start`` is what the rank held
    when training began, ``peak`` the most it held until training ended (validation runs
    included); ``peak_since`` is ``"train start"``, or ``"process start"`` where the peak
    could not be reset. Collective at the end of training (one all-gather): every rank runs it.
    """

    def __init__(self, filename: str = "memory.json") -> None:
        self.filename = filename
        self._start = 0
        self._peak_since = "train start"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._start = torch.cuda.memory_allocated(pl_module.device)
        else:
            self._start = status_bytes("VmRSS")
            if not reset_peak_rss():
                self._peak_since = "process start"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        peak = (
            torch.cuda.max_memory_allocated(device)
            if device.type == "cuda"
            else status_bytes("VmHWM")
        )
        mine = torch.tensor([self._start, peak], dtype=torch.float64, device=device)
        ranks = trainer.strategy.all_gather(mine).reshape(-1, 2).tolist()
        path = run_dir(trainer) / self.filename  # on every rank: log_dir is a collective
        if not trainer.is_global_zero:
            return
        report = {
            "device": device.type,
            "step": trainer.global_step,
            "peak_since": self._peak_since,
            "malloc_mmap_threshold": os.environ.get(MMAP_THRESHOLD),
            "ranks": [
                {
                    "rank": rank,
                    "start_mib": round(start / MIB, 2),
                    "peak_mib": round(peak / MIB, 2),
                    "peak_above_start_mib": round((peak - start) / MIB, 2),
                }
                for rank, (start, peak) in enumerate(ranks)
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
