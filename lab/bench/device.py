"""The attention benchmark on an accelerator: ``lab/scripts/bench_attention.py --device cuda``.

One process, every length in turn; per length, every system on the same inputs:

* ``ours``: ``dilated_attention`` with the given pattern (its ``kernel="auto"`` choice);
* ``sdpa``: dense ``scaled_dot_product_attention`` with the backend PyTorch picks, and
  ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``: the same forced to one backend
  (``torch.nn.attention.sdpa_kernel``); a backend that cannot run the call is a noted row.

Times are medians of device-synchronised repeats (CUDA events around forward, and around
forward + backward, after one warm-up); memory is the peak the allocator reports during one
forward + backward above what was allocated before it (q, k, v, the upstream gradient), the
GPU counterpart of the CPU benchmark's peak RSS. The error is the largest absolute difference
on sampled rows of batch 0 against a float64 reference of the function each system computes
(``common.reference_rows``). The same code runs on the CPU (perf_counter timing, no memory
figure), which is how it is tested.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lab.bench.common import reference_rows, sample_rows, sdpa
from longnet.attention import DilatedPattern, dilated_attention

METHOD = (
    "medians of CUDA-event timed repeats after one warm-up, forward under `torch.no_grad()`, "
    "forward + backward with an upstream gradient; extra MiB = the allocator's peak during "
    "forward + backward above what was allocated before it (q, k, v and the upstream "
    "gradient); max err = largest |out - ref| on sampled rows of batch 0, ref = float64 "
    "softmax(q k^T * scale + log C) v (dense attention for the SDPA rows)"
)
SYSTEMS = ("ours", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
HEADER = ["n", "system", "runs", "fwd ms", "fwd+bwd ms", "fwd+bwd vs sdpa",
          "extra MiB fwd+bwd", "extra vs sdpa", "max err vs fp64"]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _forced_sdpa(backend: str, causal: bool) -> Attention:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(chosen):
            return sdpa(q, k, v, causal)

    return attend


def make_systems(names: list[str], pattern: DilatedPattern, n: int,
                 causal: bool) -> dict[str, tuple[Attention, DilatedPattern]]:
    """``name -> (function, the pattern it computes)`` for the systems to run at length ``n``."""
    systems: dict[str, tuple[Attention, DilatedPattern]] = {}
    for name in names:
        if name == "ours":
            systems[name] = (
                lambda q, k, v: dilated_attention(q, k, v, pattern, causal=causal), pattern
            )
        elif name == "sdpa":
            systems[name] = (lambda q, k, v: sdpa(q, k, v, causal), DilatedPattern.dense(n))
        else:
            systems[name] = (_forced_sdpa(name.removeprefix("sdpa-"), causal),
                             DilatedPattern.dense(n))
    return systems


class Clock:
    """Elapsed milliseconds of a callable: CUDA events on a CUDA device, else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, action: Callable[[], object]) -> float:
        if not self.cuda:
            started = time.perf_counter()
            action()
            return (time.perf_counter() - started) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        action()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


@dataclass
class DevicePoint:
    """What one system measured at one length (times in ms, memory in bytes)."""

    system: str
    n: int
    fwd_ms: list[float] = field(default_factory=list)
    fwd_bwd_ms: list[float] = field(default_factory=list)
    extra_bytes: int | None = None
    max_error: float | None = None
    note: str = ""

    def median(self, key: str) -> float | None:
        samples = getattr(self, key)
        return statistics.median(samples) if samples else None


def make_inputs(n: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and the upstream gradient ``(batch, n, heads, head_dim)``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, n, heads, head_dim)
    q, k, v, grad = (torch.randn(shape, generator=generator, device=device, dtype=dtype)
                     for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def measure(name: str, fn: Attention, reference: DilatedPattern, inputs: tuple[torch.Tensor, ...],
            *, repeats: int, causal: bool, check_rows: int, seed: int) -> DevicePoint:
    """Time, memory and error of one system on ``inputs`` (a failure is a noted point)."""
    q, k, v, grad = inputs
    n, device = q.shape[1], q.device
    point, clock = DevicePoint(name, n), Clock(device)

    def forward_backward() -> None:
        fn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    try:
        with torch.no_grad():
            out = fn(q, k, v)
        rows = torch.tensor(sample_rows(n, check_rows, seed))
        expected = reference_rows(*(t.detach().cpu() for t in (q, k, v)), reference, rows, causal)
        point.max_error = (out[0, rows.to(device)].double().cpu() - expected).abs().max().item()
        del out
        forward_backward()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        for _ in range(repeats):
            with torch.no_grad():
                point.fwd_ms.append(clock(lambda: fn(q, k, v)))
            point.fwd_bwd_ms.append(clock(forward_backward))
        if device.type == "cuda":
            point.extra_bytes = torch.cuda.max_memory_allocated(device) - before
    except Exception as error:  # a backend that cannot run the call is a result
        point.note = f"failed: {type(error).__name__}: {error}"[:160]
        point.fwd_ms, point.fwd_bwd_ms = [], []
    return point


def measure_length(n: int, pattern: DilatedPattern, names: list[str], *, batch: int, heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device, causal: bool,
                   repeats: int, check_rows: int, seed: int) -> list[DevicePoint]:
    """Every system at length ``n`` on the same inputs."""
    inputs = make_inputs(n, batch, heads, head_dim, dtype, device, seed)
    systems = make_systems(names, pattern, n, causal)
    points = [measure(name, fn, reference, inputs, repeats=repeats, causal=causal,
                      check_rows=check_rows, seed=seed + 1)
              for name, (fn, reference) in systems.items()]
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return points


def table_rows(points: list[DevicePoint]) -> list[list[str]]:
    """Rows of ``HEADER``; ratios against ``sdpa`` (PyTorch's own backend choice) at each n."""
    baseline = {p.n: p for p in points if p.system == "sdpa"}
    rows = []
    for p in points:
        base = baseline.get(p.n)
        time_ratio = mem_ratio = "-"
        if base is not None and p.median("fwd_bwd_ms") and base.median("fwd_bwd_ms"):
            time_ratio = f"{p.median('fwd_bwd_ms') / base.median('fwd_bwd_ms'):.3f}x"
        if base is not None and p.extra_bytes and base.extra_bytes:
            mem_ratio = f"{p.extra_bytes / base.extra_bytes:.2f}x"
        if not p.fwd_bwd_ms:
            rows.append([str(p.n), p.system, "0", "-", "-", "-", "-", "-", p.note or "-"])
            continue
        rows.append([
            str(p.n), p.system, str(len(p.fwd_bwd_ms)), f"{p.median('fwd_ms'):.3f}",
            f"{p.median('fwd_bwd_ms'):.3f}", time_ratio,
            "-" if p.extra_bytes is None else f"{p.extra_bytes / 2**20:.0f}", mem_ratio,
            f"{p.max_error:.1e}",
        ])
    return rows


def plot(points: list[DevicePoint], path, title: str) -> None:
    """Forward + backward time against length, one line per system (log-log)."""
    from lab.bench.common import log2_axis, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for system in dict.fromkeys(p.system for p in points):
        done = sorted((p.n, p.median("fwd_bwd_ms")) for p in points
                      if p.system == system and p.fwd_bwd_ms)
        if done:
            ax.plot([d[0] for d in done], [d[1] for d in done], marker="o", label=system)
    lengths = sorted({p.n for p in points})
    log2_axis(ax, "sequence length", "forward + backward, ms", ticks=lengths, log_y=True)
    save_figure(fig, path, title, dpi=120)
