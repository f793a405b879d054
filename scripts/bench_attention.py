"""Benchmark exact dilated attention against dense SDPA: time, peak memory and error vs length.

    python scripts/bench_attention.py --lengths 2048 4096 8192 --pattern 2048,4096,8192/1,2,4 \
        --causal [--heads 8 --head-dim 64 --batch 1 --dtype float32 --repeats 5 --out docs/]

Systems (one row each per length):

* ``ours``: ``longnet.attention.dilated_attention`` with the given pattern;
* ``sdpa``: dense ``torch.nn.functional.scaled_dot_product_attention`` (up to ``--sdpa-max-len``);
* ``dilated-attention-pytorch``: ``DilatedAttention`` of that package when it imports (its
  import error is recorded otherwise).

Per length the script times forward (under ``torch.no_grad``) and forward+backward (with an
upstream gradient; q/k/v gradients accumulated) for all systems interleaved (ours, sdpa, ours,
sdpa, ...; the order flips every repeat) and reports medians; the number of repeats is capped
by ``--point-budget`` seconds per length. The max error is taken on ``--check-rows`` sampled
query rows of batch element 0 against a float64 dense computation of the function the system
claims to compute: ``softmax(q k^T * scale + log C) v`` with ``C`` from
``DilatedPattern.key_multiplicity`` (dense attention for SDPA). Peak memory is measured in a
fresh child process per (system, length, mode) (see ``MEMORY_DEFINITION``).

Pattern: ``geometric`` (LongNet: ``w = 2048 * 2**i, r = 2**i`` for every ``w <= n``),
``dense``, or explicit ``2048,4096,8192/1,2,4`` or ``2048:1,4096:2,8192:4``.

Every length is timed in its own child process and every memory point is measured in another
one, so an out-of-memory kill is recorded as a failed point, not a lost run.

Outputs: a table on stdout (a progress line per point), ``<out>/bench_attention_<tag>.png``
and the block ``<tag>`` of the attention section of ``<out>/benchmarks.md`` (replaced if it
exists). ``--json PATH`` also writes every sample.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from longnet.attention import DilatedPattern, dilated_attention

ROOT = Path(__file__).resolve().parents[1]
ATTENTION_DIR = Path(sys.modules[DilatedPattern.__module__].__file__).resolve().parent
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SYSTEMS = ("ours", "sdpa", "dilated-attention-pytorch")
MIB = 2**20
MEMORY_DEFINITION = (
    "**Peak extra memory** = peak RSS of a fresh child process during one call minus its RSS "
    "right after q, k, v and the upstream gradient were allocated and filled. It counts the "
    "output, saved activations, dq/dk/dv (fwd+bwd) and every temporary, but not q, k, v and "
    "the upstream gradient. **total** adds those inputs back (peak RSS minus the RSS before "
    "q, k, v, grad existed). How: one child process per (system, length, mode); a warm-up call "
    "of the same system at 256 tokens; glibc's mmap threshold fixed at 128 KiB "
    "(`MALLOC_MMAP_THRESHOLD_`) so that freed buffers leave the RSS; the kernel's peak-RSS "
    "mark `VmHWM` is reset (`/proc/self/clear_refs`) after the inputs exist and read after "
    "the call. (`ru_maxrss` is not used: across the parent's vfork+exec it inherits the "
    "parent's peak RSS.) `fwd` runs under `torch.no_grad()`; `fwd+bwd` is "
    "`out = f(q, k, v); out.backward(grad)` with q.grad, k.grad, v.grad allocated by it."
)
METHOD = (
    "times are medians (and the minimum) of `runs` timed calls per point after one warm-up "
    "call per system (above `--warmup-max-len` tokens: no warm-up, one timed call), systems "
    "interleaved (order flipped every repeat); `fwd` under "
    "`torch.no_grad()`, `fwd+bwd` = forward + `backward(grad)`; `cpu s` = process CPU time "
    "(all threads, median); `load` = 1-minute load average when the point started (the "
    "machine is shared). Max error: max |out - ref| over all heads and "
    "dims of sampled query rows (first, last and random; batch element 0) of the first "
    "forward output, ref = float64 softmax(q k^T * scale + log C) v over all keys with C from "
    "`DilatedPattern.key_multiplicity` (for SDPA: dense attention)."
)
ENV_VARS = ("PYTHONPATH", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
"""Environment variables that change CPU timings; recorded in the command when set."""
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- patterns


def parse_pattern(spec: str) -> str | DilatedPattern:
    """``geometric`` / ``dense`` (resolved per length) or an explicit pattern."""
    if spec in ("geometric", "dense"):
        return spec
    if "/" in spec:
        segments, rates = spec.split("/")
        pairs = list(zip(_ints(segments), _ints(rates), strict=True))
    else:
        pairs = [tuple(_ints(pair.replace(":", ","))) for pair in spec.split(",")]
    return DilatedPattern.coerce(pairs)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def resolve_pattern(spec: str | DilatedPattern, n: int) -> DilatedPattern:
    """The pattern used at length ``n``."""
    if spec == "dense":
        return DilatedPattern.dense(n)
    if spec == "geometric":
        branches = max(1, (n // 2048).bit_length())  # every w = 2048 * 2**i <= n (at least one)
        return DilatedPattern.geometric(branches)
    return spec


def describe_pattern(spec: str | DilatedPattern) -> str:
    if isinstance(spec, DilatedPattern):
        return f"w={spec.segment_lengths}, r={spec.dilation_rates}"
    if spec == "geometric":
        return "geometric: w = 2048 * 2**i, r = 2**i for every w <= n"
    return "dense: one branch w = n, r = 1"


# --------------------------------------------------------------------------- systems


@dataclass
class System:
    name: str
    fn: Attention | None  # None: not run at this length (see note)
    reference: DilatedPattern  # the function it claims to compute
    note: str = ""


def _dap_import() -> tuple[type | None, str]:
    try:
        from dilated_attention_pytorch.dilated_attention import DilatedAttention
    except Exception as error:  # any import failure is a result to record
        return None, f"not importable: {type(error).__name__}: {error}"
    return DilatedAttention, ""


def make_systems(
    names: list[str], pattern: DilatedPattern, n: int, causal: bool, sdpa_max_len: int
) -> list[System]:
    """The systems to compare at length ``n``."""
    systems = []
    for name in names:
        if name == "ours":
            fn = lambda q, k, v, p=pattern: dilated_attention(q, k, v, p, causal=causal)
            systems.append(System(name, fn, pattern))
        elif name == "sdpa":
            dense = DilatedPattern.dense(n)
            if n > sdpa_max_len:
                note = f"skipped above {sdpa_max_len} tokens (--sdpa-max-len)"
                systems.append(System(name, None, dense, note))
            else:
                systems.append(System(name, lambda q, k, v: _sdpa(q, k, v, causal), dense))
        elif name == "dilated-attention-pytorch":
            module_class, reason = _dap_import()
            if module_class is None:
                systems.append(System(name, None, pattern, reason))
            else:
                module = module_class(pattern.segment_lengths, pattern.dilation_rates)
                fn = lambda q, k, v, m=module: m(q, k, v, is_causal=causal)
                systems.append(System(name, fn, pattern))
    return systems


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def sdpa_backend(causal: bool) -> str:
    """The aten attention op SDPA dispatches to for these inputs (read from the profiler)."""
    q = torch.randn(1, 256, 2, 64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _sdpa(q, q, q, causal).sum().backward()
    names = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    return ", ".join(sorted(names)) or "math (no fused aten op seen)"


# --------------------------------------------------------------------------- inputs, reference


@dataclass
class Shape:
    batch: int
    heads: int
    head_dim: int
    dtype: str

    def dims(self, n: int) -> tuple[int, int, int, int]:
        return (self.batch, n, self.heads, self.head_dim)

    def tensor_bytes(self, n: int) -> int:
        return math.prod(self.dims(n)) * DTYPES[self.dtype].itemsize


def make_inputs(shape: Shape, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and the upstream gradient, filled in place (no temporaries)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(4):
        t = torch.empty(shape.dims(n), dtype=DTYPES[shape.dtype])
        tensors.append(t.normal_(generator=generator))
    q, k, v, grad = tensors
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def sample_rows(n: int, count: int, seed: int) -> torch.Tensor:
    """``count`` query positions: the first, the last and random ones in between."""
    generator = torch.Generator().manual_seed(seed + 1)
    rows = torch.randperm(n, generator=generator)[: max(count - 2, 0)]
    return torch.unique(torch.cat([torch.tensor([0, n - 1]), rows]))[:count]


def reference_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: DilatedPattern,
    rows: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Float64 ``softmax(q k^T * scale + log C) v`` of batch 0 at ``rows``: ``(rows, heads, dim)``.

    Counts are built in row chunks (bounded memory) and stored as uint8; scores over all keys
    are computed one head at a time.
    """
    _, n, heads, dim = q.shape
    positions = torch.arange(n)
    chunk = max(1, 2**25 // (heads * n))
    counts = torch.cat(
        [
            pattern.key_multiplicity(part, positions, heads, causal).to(torch.uint8)
            for part in rows.split(chunk)
        ],
        dim=1,
    )  # (heads, rows, n)
    out = torch.zeros(len(rows), heads, dim, dtype=torch.float64)
    for h in range(heads):
        k_h, v_h = k[0, :, h].double(), v[0, :, h].double()
        scores = q[0, rows, h].double() @ k_h.T * dim**-0.5 + counts[h].double().log()
        has_key = (counts[h] > 0).any(dim=1)
        probs = torch.softmax(scores[has_key], dim=-1)
        out[has_key, h] = probs @ v_h
    return out


def max_error(out: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor) -> float:
    return (out[0, rows].double() - reference).abs().max().item()


# --------------------------------------------------------------------------- timing


def run_forward(fn: Attention, q, k, v) -> torch.Tensor:
    with torch.no_grad():
        return fn(q, k, v)


def run_forward_backward(fn: Attention, q, k, v, grad) -> None:
    fn(q, k, v).backward(grad)
    q.grad = k.grad = v.grad = None


def timed(action: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


@dataclass
class Point:
    """Everything measured for one (system, length)."""

    system: str
    n: int
    branches: list[list[int]]
    note: str = ""
    runs: int = 0
    load: float = 0.0  # 1-minute load average when the point started
    fwd_s: list[float] = field(default_factory=list)
    fwd_bwd_s: list[float] = field(default_factory=list)
    fwd_cpu_s: list[float] = field(default_factory=list)
    fwd_bwd_cpu_s: list[float] = field(default_factory=list)
    max_error: float | None = None
    memory: dict[str, dict] = field(default_factory=dict)  # mode -> child result

    def median(self, key: str) -> float | None:
        samples = getattr(self, key)
        return statistics.median(samples) if samples else None

    def add(self, fwd: tuple[float, float], fwd_bwd: tuple[float, float]) -> None:
        """Record one timed forward and forward+backward ``(wall, cpu)``."""
        self.fwd_s.append(fwd[0])
        self.fwd_cpu_s.append(fwd[1])
        self.fwd_bwd_s.append(fwd_bwd[0])
        self.fwd_bwd_cpu_s.append(fwd_bwd[1])

    def minimum(self, key: str) -> float | None:
        samples = getattr(self, key)
        return min(samples) if samples else None


def time_length(
    systems: list[System], shape: Shape, n: int, args: argparse.Namespace
) -> dict[str, Point]:
    """Interleaved timing and the error check of every runnable system at length ``n``.

    Up to ``--warmup-max-len`` tokens: one warm-up call per system (its forward output is the
    one checked), then ``runs`` interleaved timed repeats. Above it: no warm-up and exactly one
    timed forward (checked) and one timed forward+backward per system.
    """
    points = {
        s.name: Point(s.name, n, [list(b) for b in s.reference.branches], s.note) for s in systems
    }
    runnable = [s for s in systems if s.fn is not None]
    if not runnable:
        return points
    load = os.getloadavg()[0]
    q, k, v, grad = make_inputs(shape, n, args.seed)
    rows = sample_rows(n, args.check_rows, args.seed)
    warm = n <= args.warmup_max_len
    first_s = 0.0
    for system in runnable:
        point = points[system.name]
        try:
            outputs: list[torch.Tensor] = []
            fwd = timed(lambda s=system, o=outputs: o.append(run_forward(s.fn, q, k, v)))
            reference = reference_rows(q, k, v, system.reference, rows, args.causal)
            point.max_error = max_error(outputs.pop(), reference, rows)
            del reference
            fwd_bwd = timed(lambda s=system: run_forward_backward(s.fn, q, k, v, grad))
        except Exception as error:  # a failing system is a result, not a crash
            point.note = f"failed: {type(error).__name__}: {error}"[:200]
            system.fn = None
            continue
        first_s += fwd[0] + fwd_bwd[0]
        if not warm:
            point.add(fwd, fwd_bwd)
    runnable = [s for s in runnable if s.fn is not None]
    repeats = max(1, min(args.repeats, int(args.point_budget / max(first_s, 1e-9))))
    for repeat in range(repeats if warm else 0):
        order = runnable if repeat % 2 == 0 else runnable[::-1]
        fwd = {s.name: timed(lambda s=s: run_forward(s.fn, q, k, v)) for s in order}
        fwd_bwd = {
            s.name: timed(lambda s=s: run_forward_backward(s.fn, q, k, v, grad)) for s in order
        }
        for system in order:
            points[system.name].add(fwd[system.name], fwd_bwd[system.name])
    for system in runnable:
        points[system.name].runs = repeats if warm else 1
        points[system.name].load = load
    return points


# --------------------------------------------------------------------------- memory (child)


def _status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``: now, ``VmHWM``: peak) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def memory_child(config: dict) -> dict:
    """Runs in a fresh process: peak RSS growth of one system, one length, one mode."""
    if config.get("threads"):
        torch.set_num_threads(config["threads"])
    shape = Shape(**config["shape"])
    pattern = DilatedPattern.coerce(config["branches"])
    n, mode, causal = config["n"], config["mode"], config["causal"]
    system_at = lambda length: make_systems(
        [config["system"]], resolve_pattern(pattern, length), length, causal, n
    )[0]
    warm = min(n, 256)
    q, k, v, grad = make_inputs(shape, warm, 0)
    run_forward_backward(system_at(warm).fn, q, k, v, grad)
    del q, k, v, grad
    fn = system_at(n).fn
    before_inputs = _status_bytes("VmRSS")
    q, k, v, grad = make_inputs(shape, n, config["seed"])
    after_inputs, peak_before = _status_bytes("VmRSS"), _status_bytes("VmHWM")
    peak_reset = reset_peak_rss()
    if mode == "fwd":
        out = run_forward(fn, q, k, v)
        del out
    else:
        fn(q, k, v).backward(grad)
    peak = _status_bytes("VmHWM")
    return {
        "sources": attention_digest(),
        "peak_reset": peak_reset,
        "extra_bytes": peak - after_inputs,
        "total_bytes": peak - before_inputs,
        "inputs_bytes": after_inputs - before_inputs,
        "peak_rss_bytes": peak,
        "peak_before_bytes": peak_before,
    }


def run_child(flag: str, value: str, argv: list[str], env: dict[str, str]) -> dict:
    """Run this script with ``flag value`` in a fresh interpreter and return its ``RESULT``
    line; a child killed by a signal (the OOM killer) is reported as ``{"error": ...}``."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, flag, value]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    if done.returncode < 0:
        reason = f"killed by signal {-done.returncode} (SIGKILL: out of memory?)"
    else:
        reason = f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    return {"error": f"child {reason}"}


def measure_memory(system: str, n: int, mode: str, pattern: DilatedPattern, args) -> dict:
    """Peak memory of one (system, length, mode) from :func:`memory_child`."""
    config = {
        "system": system,
        "n": n,
        "mode": mode,
        "branches": [list(b) for b in pattern.branches],
        "causal": args.causal,
        "seed": args.seed,
        "threads": args.threads,
        "shape": asdict(args.shape),
    }
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    return run_child("--memory-child", json.dumps(config), [], env)


def measure_length(n: int, args: argparse.Namespace, argv: list[str]) -> list[Point]:
    """Timing and error check of every system at length ``n`` in a child process (so that an
    out-of-memory kill loses one point, not the run), then the memory children."""
    pattern = resolve_pattern(args.pattern, n)
    systems = make_systems(args.systems, pattern, n, args.causal, args.sdpa_max_len)
    result = run_child("--timing-child", str(n), argv, dict(os.environ))
    points = []
    for system in systems:
        if "error" in result:
            branches = [list(b) for b in system.reference.branches]
            point = Point(system.name, n, branches, system.note or f"timing {result['error']}")
        else:
            point = Point(**result[system.name])
        if point.runs and not args.no_memory:
            for mode in ("fwd", "fwd+bwd"):
                point.memory[mode] = measure_memory(system.name, n, mode, pattern, args)
        print(progress(point), flush=True)
        points.append(point)
    return points


def timing_child(n: int, args: argparse.Namespace) -> dict:
    pattern = resolve_pattern(args.pattern, n)
    systems = make_systems(args.systems, pattern, n, args.causal, args.sdpa_max_len)
    points = time_length(systems, args.shape, n, args)
    return {name: asdict(point) for name, point in points.items()}


# --------------------------------------------------------------------------- report


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def fmt_mib(result: dict | None, key: str = "extra_bytes") -> str:
    if not result:
        return "-"
    if "error" in result:
        return "failed"
    return f"{result[key] / MIB:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table_rows(points: list[Point]) -> list[list[str]]:
    header = [
        "n", "system", "runs", "load", "fwd s", "fwd+bwd s", "fwd+bwd min s", "fwd+bwd cpu s",
        "fwd+bwd vs sdpa (median; min)", "extra MiB fwd", "extra MiB fwd+bwd",
        "total MiB fwd+bwd", "extra vs sdpa", "max err vs fp64",
    ]  # fmt: skip
    rows = [header]
    by_n: dict[int, dict[str, Point]] = {}
    for p in points:
        by_n.setdefault(p.n, {})[p.system] = p
    for n, systems in by_n.items():
        sdpa = systems.get("sdpa")
        for p in systems.values():
            if not p.runs:
                continue
            fb = p.memory.get("fwd+bwd")
            sdpa_fb = sdpa.memory.get("fwd+bwd") if sdpa else None
            extra = fb.get("extra_bytes") if fb else None
            sdpa_extra = sdpa_fb.get("extra_bytes") if sdpa_fb else None
            vs_sdpa = "-"
            if sdpa and sdpa.runs:
                vs_sdpa = (
                    f"{ratio(p.median('fwd_bwd_s'), sdpa.median('fwd_bwd_s'))}; "
                    f"{ratio(p.minimum('fwd_bwd_s'), sdpa.minimum('fwd_bwd_s'))}"
                )
            rows.append([
                str(n), p.system, str(p.runs), f"{p.load:.1f}", fmt(p.median("fwd_s")),
                fmt(p.median("fwd_bwd_s")), fmt(p.minimum("fwd_bwd_s")),
                fmt(p.median("fwd_bwd_cpu_s")), vs_sdpa,
                fmt_mib(p.memory.get("fwd")), fmt_mib(fb), fmt_mib(fb, "total_bytes"),
                ratio(extra, sdpa_extra), fmt(p.max_error, ".1e"),
            ])  # fmt: skip
    return rows


def notes(points: list[Point]) -> list[str]:
    """One line per distinct (system, note): skipped or not importable systems."""
    seen: dict[tuple[str, str], list[int]] = {}
    for p in points:
        if p.note:
            seen.setdefault((p.system, p.note), []).append(p.n)
    return [
        f"{system}: {note} (n = {', '.join(map(str, ns))})" for (system, note), ns in seen.items()
    ]


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot(points: list[Point], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [("fwd_s", "forward time [s]"), ("fwd_bwd_s", "forward+backward time [s]")]
    for color, system in zip(("C0", "C1", "C2"), SYSTEMS):
        mine = [p for p in points if p.system == system and p.runs]
        if not mine:
            continue
        for ax, (key, label) in zip(axes, panels):
            ax.plot([p.n for p in mine], [p.median(key) for p in mine], "o-", color=color,
                    label=system)  # fmt: skip
            ax.set_ylabel(label)
        for mode, style in (("fwd+bwd", "o-"), ("fwd", "s--")):
            mem = [(p.n, p.memory[mode]["extra_bytes"] / MIB) for p in mine
                   if "extra_bytes" in p.memory.get(mode, {})]  # fmt: skip
            if mem:
                axes[2].plot(*zip(*mem), style, color=color, label=f"{system} {mode}")
    axes[2].set_ylabel("peak extra memory [MiB]")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attention_digest() -> str:
    """sha256 (12 hex digits) of the ``longnet/attention`` sources this process imported."""
    digest = hashlib.sha256()
    for path in sorted(ATTENTION_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def head_digest() -> tuple[str, str]:
    """Short git HEAD of the repository and the digest of its committed ``longnet/attention``."""
    git = lambda *cmd: (
        subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, check=True).stdout
    )
    try:
        head = git("rev-parse", "--short", "HEAD").decode().strip()
        names = git("ls-tree", "--name-only", "HEAD", "longnet/attention/").decode().split()
        digest = hashlib.sha256()
        for name in sorted(n for n in names if n.endswith(".py")):
            digest.update(Path(name).name.encode() + b"\0" + git("show", f"HEAD:{name}"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", ""
    return head, digest.hexdigest()[:12]


def source_version(digest: str) -> str:
    head, committed = head_digest()
    state = "identical to" if digest == committed else "NOT identical to (uncommitted changes)"
    head += " (HEAD when the run started)"
    where = (
        "" if ATTENTION_DIR == ROOT / "longnet" / "attention" else f", loaded from {ATTENTION_DIR}"
    )
    return f"longnet/attention sources sha256 {digest} {state} commit {head}{where}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    return (
        f"`{platform.platform()}`, {os.cpu_count()} CPUs ({cpu_model()}), "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.1f} GiB RAM"
    )


def consistency_notes(points: list[Point], digest: str) -> list[str]:
    """Warnings when the attention sources changed on disk during the run."""
    warnings = []
    if attention_digest() != digest:
        warnings.append(
            f"WARNING: longnet/attention changed on disk during the run; timings used the "
            f"sources loaded at start (sha256 {digest}), now {attention_digest()}"
        )
    for p in points:
        for mode, result in p.memory.items():
            if result.get("sources", digest) != digest:
                warnings.append(
                    f"WARNING: memory child {p.system} n={p.n} {mode} ran attention sources "
                    f"{result['sources']}, not {digest}"
                )
    for line in warnings:
        print(line)
    return warnings


def markdown_block(points: list[Point], args, run: dict) -> str:
    shape = args.shape
    lines = [
        f"### {args.tag}",
        "",
        f"- pattern: {describe_pattern(args.pattern)}; causal={args.causal}; batch {shape.batch}, "
        f"{shape.heads} heads, head_dim {shape.head_dim}, {shape.dtype}",
        f"- command: `{run['command']}`",
        f"- date: {run['date']}; wall time of the run {run['wall_s']:.0f} s; load average "
        f"(1 min) at start {run['load_start']:.2f}, at end {run['load_end']:.2f}",
        f"- machine: {run['machine']}",
        f"- code: {run['version']}",
        *[f"- {line}" for line in run["warnings"]],
        f"- dense SDPA runs as: {run['sdpa_backend']}",
        f"- method: {METHOD}",
        *[f"- {line}" for line in notes(points)],
        "",
        markdown_table(table_rows(points)),
        "",
        f"![time and memory vs length]({run['plot']})",
    ]
    return "\n".join(lines)


def update_doc(path: Path, tag: str, block: str) -> None:
    """Replace (or append) block ``tag`` in the attention section of ``benchmarks.md``."""
    begin, end = f"<!-- bench_attention:{tag}:begin -->", f"<!-- bench_attention:{tag}:end -->"
    wrapped = f"{begin}\n{block}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text:
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        text = pattern.sub(lambda _: wrapped, text)
    else:
        if "\n## Attention" not in text:
            text = text.rstrip("\n") + "\n\n## Attention\n\n" + MEMORY_DEFINITION + "\n"
        section = text.index("\n## Attention")
        following = text.find("\n## ", section + 1)
        cut = len(text) if following < 0 else following
        text = text[:cut].rstrip("\n") + "\n\n" + wrapped + "\n" + text[cut:]
    path.write_text(text.rstrip("\n") + "\n")


# --------------------------------------------------------------------------- main


def progress(point: Point) -> str:
    if not point.runs:
        return f"n={point.n:>8} {point.system:>26}: {point.note}"
    memory = " ".join(
        f"{mode} {fmt_mib(point.memory.get(mode))} MiB" for mode in ("fwd", "fwd+bwd")
    )
    return (
        f"n={point.n:>8} {point.system:>26}: fwd {fmt(point.median('fwd_s'))} s, fwd+bwd "
        f"{fmt(point.median('fwd_bwd_s'))} s (min {fmt(point.minimum('fwd_bwd_s'))} s, "
        f"{point.runs} runs, load {point.load:.1f}), err "
        f"{fmt(point.max_error, '.1e')}, extra memory {memory}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--pattern", default="2048,4096,8192/1,2,4", type=parse_pattern)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (max)")
    parser.add_argument("--point-budget", type=float, default=120.0,
                        help="fewer repeats when the warm-up says a length would take longer "
                             "than this many seconds (at least 1 run)")  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--warmup-max-len", type=int, default=262144,
                        help="above this length: no warm-up call and one timed run")  # fmt: skip
    parser.add_argument("--sdpa-max-len", type=int, default=32768)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--check-rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--tag", default=None, help="name of the plot and the doc block")
    parser.add_argument("--no-doc", action="store_true", help="do not touch benchmarks.md")
    parser.add_argument("--json", type=Path, default=None, help="also write all samples here")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timing-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shape = Shape(args.batch, args.heads, args.head_dim, args.dtype)
    if args.tag is None:
        name = (
            args.pattern
            if isinstance(args.pattern, str)
            else "-".join(f"{w}x{r}" for w, r in args.pattern.branches)
        )
        args.tag = f"{'causal' if args.causal else 'bidirectional'}-{name}-{args.dtype}"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        print("RESULT " + json.dumps(memory_child(json.loads(args.memory_child))), flush=True)
        return
    if args.timing_child is not None:
        print("RESULT " + json.dumps(timing_child(args.timing_child, args)), flush=True)
        return
    started, load_start, digest = time.time(), os.getloadavg()[0], attention_digest()
    version = source_version(digest)  # before the run: HEAD may move while it runs
    print(version)
    print(f"{args.tag}: {describe_pattern(args.pattern)}, causal={args.causal}, {args.shape}")
    argv = sys.argv[1:] if argv is None else argv
    points = [point for n in args.lengths for point in measure_length(n, args, argv)]
    changed = consistency_notes(points, digest)
    rows = table_rows(points)
    print("\n" + text_table(rows))
    for line in notes(points):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_path = args.out / f"bench_attention_{args.tag}.png"
    title = f"{args.tag}: {describe_pattern(args.pattern)}, {args.shape}"
    plot(points, plot_path, title)
    run = {
        "command": " ".join(
            [f"{name}={os.environ[name]}" for name in ENV_VARS if name in os.environ]
            + ["python scripts/bench_attention.py", shlex.join(sys.argv[1:])]
        ),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "wall_s": time.time() - started,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "machine": machine(),
        "version": version,
        "sdpa_backend": sdpa_backend(args.causal),
        "plot": plot_path.name,
        "warnings": changed,
    }
    print(f"plot: {plot_path}; wall time {run['wall_s']:.0f} s")
    if not args.no_doc:
        update_doc(args.out / "benchmarks.md", args.tag, markdown_block(points, args, run))
        print(f"updated {args.out / 'benchmarks.md'} block {args.tag}")
    if args.json:
        samples = [asdict(p) for p in points]
        args.json.write_text(json.dumps({"run": run, "points": samples}, indent=1))


if __name__ == "__main__":
    main()
