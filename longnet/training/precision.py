"""``precision: auto``: the training precision chosen by the hardware.

bfloat16 autocast (``bf16-mixed``) pays for its casts only where the hardware multiplies
bfloat16 matrices natively: CUDA GPUs that support bfloat16, and CPUs with bfloat16 matrix
units, AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``) in the flags of ``/proc/cpuinfo``.
Elsewhere autocast is slower than float32 (it converts every weight and activation and then
multiplies in float32 anyway), so ``auto`` is ``32-true`` there.

:class:`AutoPrecisionTrainer` is Lightning's ``Trainer`` that accepts ``precision="auto"``;
the ``longnet`` command builds its trainer with it, and logs the choice and its reason in one
line (``Precision: bf16-mixed (auto: ...)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_info

AUTO = "auto"
CPU_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}
"""``/proc/cpuinfo`` flags of bfloat16 matrix units, and their names."""
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags (the ``flags`` line of ``/proc/cpuinfo``); empty where that
    file does not exist (not Linux) or has no such line."""
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
    """The precision ``auto`` stands for on ``device``, and why: ``("bf16-mixed", reason)``
    where the hardware multiplies bfloat16 natively, else ``("32-true", reason)``.

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
    """The device kind an ``accelerator`` argument of ``Trainer`` resolves to (None: another
    kind, e.g. ``mps``)."""
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
    """``precision`` unchanged, or for ``"auto"`` the precision of :func:`auto_precision` on
    the device ``accelerator`` names (logged in one line with the reason).

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
    """Lightning's ``Trainer``, whose ``precision`` may also be ``"auto"``
    (:func:`resolve_precision`); every other argument is the ``Trainer``'s."""

    def __init__(self, *args: Any, accelerator: str | Accelerator = "auto",
                 precision: _PRECISION_INPUT | Literal["auto"] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, accelerator=accelerator,
                         precision=resolve_precision(precision, accelerator), **kwargs)
