"""The single-device benchmark behind ``lab/scripts/bench_attention.py``: exact dilated attention
against dense SDPA and ``dilated-attention-pytorch``: time, peak memory and error vs length.

Per length the timing and error check of all systems run in one child process
(``timing_child``), each memory point in another (``memory_child``); both are the script itself
run again with a hidden flag, so that an out-of-memory kill loses one point, not the run. The
generated blocks go to the ``## Attention`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lab.bench.common import (
    DTYPES,
    MIB,
    attention_digest,
    fmt,
    log2_axis,
    malloc_env,
    markdown_table,
    mib,
    pyplot,
    ratio,
    reference_rows,
    run_lines,
    sample_rows,
    save_figure,
    sdpa,
)
from lab.bench.peers import dilated_attention_pytorch
from longnet.attention import DilatedPattern, dilated_attention
from longnet.training.reports import reset_peak_rss, status_bytes

SECTION = "## Attention"
PREFIX = "bench_attention"
"""Markers of the generated blocks: ``<!-- bench_attention:<tag>:begin -->`` ... ``:end -->``."""
SYSTEMS = ("ours", "sdpa", "dilated-attention-pytorch")
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
"""Written below the section heading when the script creates the section."""
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


def pattern_argument(spec: str) -> str | DilatedPattern:
    """argparse type of ``--pattern``: ``geometric`` / ``dense`` (resolved per length) or an
    explicit pattern, ``2048,4096/1,2`` or ``2048:1,4096:2``."""
    if spec in ("geometric", "dense"):
        return spec
    try:
        if "/" in spec:
            segments, rates = (_ints(part) for part in spec.split("/"))
            if len(segments) != len(rates):
                raise ValueError(f"{len(segments)} segment lengths but {len(rates)} rates")
            pairs = list(zip(segments, rates))
        else:
            pairs = [tuple(_ints(pair.replace(":", ","))) for pair in spec.split(",")]
        return DilatedPattern.coerce(pairs)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(
            f"cannot read {spec!r} as a pattern ({err}); write geometric, dense, "
            "2048,4096/1,2 (segments/rates) or 2048:1,4096:2."
        ) from None


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


def pattern_tag(spec: str | DilatedPattern) -> str:
    """``geometric``, ``dense`` or ``2048x1-4096x2``: part of the default ``--tag``."""
    if isinstance(spec, str):
        return spec
    return "-".join(f"{w}x{r}" for w, r in spec.branches)


# --------------------------------------------------------------------------- systems


@dataclass
class System:
    name: str
    fn: Attention | None  # None: not run at this length (see note)
    reference: DilatedPattern  # the function it claims to compute
    note: str = ""


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
                systems.append(System(name, lambda q, k, v: sdpa(q, k, v, causal), dense))
        elif name == "dilated-attention-pytorch":
            fn, reason = dilated_attention_pytorch(
                pattern.segment_lengths, pattern.dilation_rates, causal
            )
            systems.append(System(name, fn, pattern, reason))
    return systems


def sdpa_backend(causal: bool) -> str:
    """The aten attention op SDPA dispatches to for these inputs (read from the profiler)."""
    q = torch.randn(1, 256, 2, 64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sdpa(q, q, q, causal).sum().backward()
    names = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    return ", ".join(sorted(names)) or "math (no fused aten op seen)"


# --------------------------------------------------------------------------- inputs


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
    rows = torch.tensor(sample_rows(n, args.check_rows, args.seed + 1))
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


def timing_child(n: int, args: argparse.Namespace) -> dict:
    """Runs in a fresh process: ``time_length`` of every system at length ``n``."""
    pattern = resolve_pattern(args.pattern, n)
    systems = make_systems(args.systems, pattern, n, args.causal, args.sdpa_max_len)
    points = time_length(systems, args.shape, n, args)
    return {name: asdict(point) for name, point in points.items()}


# --------------------------------------------------------------------------- memory


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
    before_inputs = status_bytes("VmRSS")
    q, k, v, grad = make_inputs(shape, n, config["seed"])
    after_inputs, peak_before = status_bytes("VmRSS"), status_bytes("VmHWM")
    peak_reset = reset_peak_rss()
    if mode == "fwd":
        out = run_forward(fn, q, k, v)
        del out
    else:
        fn(q, k, v).backward(grad)
    peak = status_bytes("VmHWM")
    return {
        "sources": attention_digest(),
        "peak_reset": peak_reset,
        "extra_bytes": peak - after_inputs,
        "total_bytes": peak - before_inputs,
        "inputs_bytes": after_inputs - before_inputs,
        "peak_rss_bytes": peak,
        "peak_before_bytes": peak_before,
    }


# --------------------------------------------------------------------------- parent side


def run_child(script: Path, flag: str, value: str, argv: list[str], env: dict[str, str]) -> dict:
    """Run ``script`` with ``argv flag value`` in a fresh interpreter and return its ``RESULT``
    line; a child killed by a signal (the OOM killer) is reported as ``{"error": ...}``."""
    command = [sys.executable, str(script), *argv, flag, value]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    if done.returncode < 0:
        reason = f"killed by signal {-done.returncode} (SIGKILL: out of memory?)"
    else:
        reason = f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    return {"error": f"child {reason}"}


def measure_memory(
    script: Path, system: str, n: int, mode: str, pattern: DilatedPattern, args
) -> dict:
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
    return run_child(script, "--memory-child", json.dumps(config), [], malloc_env(fixed=True))


def measure_length(script: Path, n: int, args: argparse.Namespace, argv: list[str]) -> list[Point]:
    """Timing and error check of every system at length ``n`` in a child process (so that an
    out-of-memory kill loses one point, not the run), then the memory children."""
    pattern = resolve_pattern(args.pattern, n)
    systems = make_systems(args.systems, pattern, n, args.causal, args.sdpa_max_len)
    result = run_child(script, "--timing-child", str(n), argv, dict(os.environ))
    points = []
    for system in systems:
        if "error" in result:
            branches = [list(b) for b in system.reference.branches]
            point = Point(system.name, n, branches, system.note or f"timing {result['error']}")
        else:
            point = Point(**result[system.name])
        if point.runs and not args.no_memory:
            for mode in ("fwd", "fwd+bwd"):
                point.memory[mode] = measure_memory(script, system.name, n, mode, pattern, args)
        print(progress(point), flush=True)
        points.append(point)
    return points


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


# --------------------------------------------------------------------------- report


def fmt_mib(result: dict | None, key: str = "extra_bytes") -> str:
    """A memory child's ``key`` in whole MiB; ``failed`` / ``-`` without one."""
    if not result:
        return "-"
    if "error" in result:
        return "failed"
    return mib(result[key], ".0f")


HEADER = [
    "n", "system", "runs", "load", "fwd s", "fwd+bwd s", "fwd+bwd min s", "fwd+bwd cpu s",
    "fwd+bwd vs sdpa (median; min)", "extra MiB fwd", "extra MiB fwd+bwd",
    "total MiB fwd+bwd", "extra vs sdpa", "max err vs fp64",
]  # fmt: skip


def table_rows(points: list[Point]) -> list[list[str]]:
    """The rows under ``HEADER``: every system that ran, by length."""
    rows = []
    by_n: dict[int, dict[str, Point]] = {}
    for p in points:
        by_n.setdefault(p.n, {})[p.system] = p
    for n, systems in by_n.items():
        sdpa_point = systems.get("sdpa")
        for p in systems.values():
            if not p.runs:
                continue
            fb = p.memory.get("fwd+bwd")
            sdpa_fb = sdpa_point.memory.get("fwd+bwd") if sdpa_point else None
            extra = fb.get("extra_bytes") if fb else None
            sdpa_extra = sdpa_fb.get("extra_bytes") if sdpa_fb else None
            vs_sdpa = "-"
            if sdpa_point and sdpa_point.runs:
                vs_sdpa = (
                    f"{ratio(p.median('fwd_bwd_s'), sdpa_point.median('fwd_bwd_s'))}; "
                    f"{ratio(p.minimum('fwd_bwd_s'), sdpa_point.minimum('fwd_bwd_s'))}"
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


def plot(points: list[Point], path: Path, title: str) -> None:
    """Forward time, forward+backward time and peak extra memory vs length, per system."""
    plt = pyplot()
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
            memory = [(p.n, p.memory[mode]["extra_bytes"] / MIB) for p in mine
                      if "extra_bytes" in p.memory.get(mode, {})]  # fmt: skip
            if memory:
                axes[2].plot(*zip(*memory), style, color=color, label=f"{system} {mode}")
    axes[2].set_ylabel("peak extra memory [MiB]")
    for ax in axes:
        log2_axis(ax, "sequence length n", log_y=True)
    save_figure(fig, path, title, dpi=110)


def markdown_block(points: list[Point], args, run: dict) -> str:
    """The generated block ``args.tag`` (``run``: what ``main`` recorded about the run)."""
    shape = args.shape
    lines = [
        f"### {args.tag}",
        "",
        f"- pattern: {describe_pattern(args.pattern)}; causal={args.causal}; batch {shape.batch}, "
        f"{shape.heads} heads, head_dim {shape.head_dim}, {shape.dtype}",
        *run_lines(run, run["machine"], run["version"]),
        *[f"- {line}" for line in run["warnings"]],
        f"- dense SDPA runs as: {run['sdpa_backend']}",
        f"- method: {METHOD}",
        *[f"- {line}" for line in notes(points)],
        "",
        markdown_table(HEADER, table_rows(points)),
        "",
        f"![time and memory vs length]({run['plot']})",
    ]
    return "\n".join(lines)
