"""Sequence-parallel ring benchmark: per-rank peak memory, CPU time and bytes sent vs world size.

    python scripts/bench_ring.py --seq-len 32768 --worlds 1 2 4 8 --transports ring allgather \
        --heads 8 --head-dim 64 --dtype float32 --base-segment 2048 --spawns 2 --timed-calls 2 \
        --dense-seq-len 8192 --out docs/

Systems and cases (every case runs forward + backward, causal by default):

* ``ours``: ``dilated_attention`` on the geometric pattern ``(base * 2**i, 2**i)`` for every
  ``base * 2**i <= N``, for each world size ``P`` and transport (``P = 1`` runs without a
  group: the single-device reference, one thread).
* dense comparison at ``--dense-seq-len``: ``ours`` with the single branch ``[(N, 1)]`` against
  ``ring-attention-pytorch``'s ``ring_flash_attn`` (``ring_reduce_col=True`` for ``P > 1``: its
  ring pass, the function its ``RingAttention`` module calls on CPU).
* a small gradient check (``--grad-seq-len``): out, dq, dk, dv of both systems on every world
  size against float64 SDPA (ours also in float64).

Measurement, per case in freshly spawned gloo processes (``tests/distributed/launcher``, one
thread each), ``--spawns`` times, configurations interleaved; every time two spawns, each
starting with a warm-up call of the same system at ``256 * P`` tokens:

* memory spawn: once q, k, v and the upstream gradient exist, the peak RSS mark (``VmHWM``) is
  reset via ``/proc/self/clear_refs``; one call; **peak extra memory** = ``VmHWM`` minus the
  RSS right before the call, with glibc's mmap threshold fixed at 128 KiB
  (``MALLOC_MMAP_THRESHOLD_``) so freed buffers leave the RSS (as in the single-device
  section). Bytes sent = payload bytes of every ``isend`` passed to
  ``torch.distributed.batch_isend_irecv`` (wrapped and counted during this call; the 16-byte
  argument check ``all_reduce`` and ``ring-attention-pytorch``'s barriers are not counted).
* timing spawn, with glibc's default (adaptive) allocator settings, as users run (the fixed
  threshold maps every buffer above 128 KiB afresh and pays its page faults on every call; the
  default reuses freed buffers up to its 32 MiB ceiling and maps only larger ones afresh).
  CPU time = ``time.process_time()`` (all threads of the rank) of ``--timed-calls`` calls after
  a first one, median per rank, summed over ranks.
* kernel replay, after all spawns: the block-kernel calls every rank made in its last timed
  call (name, dtype, block shapes, causal flag; from the first timing spawn) re-run one after
  another in this process on one thread, on random blocks of the same shapes, summed over
  ranks, median of ``--replay-rounds`` interleaved rounds: the kernels' cost for the ring's
  block shapes without P ranks competing for the machine's cores.

The formula columns come from ``longnet.attention.memory`` for the same setup.

Outputs: tables on stdout, ``<out>/bench_ring.png`` (``bench_ring_<block>.png``), and in the
``## Sequence-parallel ring`` section of ``<out>/benchmarks.md`` the generated blocks ``<block>``
(default ``main``), ``dense`` and ``grads`` for the parts that ran, each replaced between its
markers (text outside the markers and other sections are kept); ``--json PATH`` every sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from longnet.attention import DilatedPattern, dilated_attention, kernels  # noqa: E402
from longnet.attention.memory import AttentionSetup, plan_memory  # noqa: E402
from tests.distributed.launcher import run_workers  # noqa: E402

MIB = 2**20
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SECTION = "## Sequence-parallel ring"
MMAP_THRESHOLD = "131072"


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One benchmark configuration: a system on ``world`` ranks over ``seq_len`` tokens."""

    system: str  # "ours" or "ring-attention-pytorch"
    world: int
    transport: str  # "ring" / "allgather" for ours; "ring" for ring-attention-pytorch
    seq_len: int
    branches: tuple[tuple[int, int], ...]
    batch: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool
    seed: int
    check_rows: tuple[int, ...]
    timed_calls: int
    bucket_size: int

    @property
    def label(self) -> str:
        kind = "dense" if self.branches == ((self.seq_len, 1),) else "dilated"
        return f"{self.system}/{kind}/P={self.world}/{self.transport}"


def geometric_branches(seq_len: int, base: int) -> tuple[tuple[int, int], ...]:
    """``(base * 2**i, 2**i)`` for every ``base * 2**i <= seq_len``."""
    branches, i = [], 0
    while base * 2**i <= seq_len:
        branches.append((base * 2**i, 2**i))
        i += 1
    return tuple(branches) or ((seq_len, 1),)


def check_rows(seq_len: int, count: int, seed: int) -> tuple[int, ...]:
    """Sampled global query rows for the error check (first, last and random ones)."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(seq_len, generator=gen)[: max(count - 2, 0)].tolist()
    return tuple(sorted({0, seq_len - 1, *picked}))


# --------------------------------------------------------------------------- worker side


def shard_inputs(case: Case, rank: int, world: int) -> list[torch.Tensor]:
    """q, k, v, d_out of ``rank``'s shard (shard ``i`` of ``world`` from its own seed)."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + rank)
    shape = (case.batch, case.seq_len // world, case.heads, case.head_dim)
    return [torch.randn(shape, generator=gen).to(DTYPES[case.dtype]) for _ in range(4)]


def global_inputs(case: Case) -> list[torch.Tensor]:
    """The global q, k, v, d_out the ranks of ``case`` hold (float64)."""
    shards = [shard_inputs(case, rank, case.world) for rank in range(case.world)]
    return [torch.cat([s[i] for s in shards], dim=1).double() for i in range(4)]


def _status_bytes(field_name: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS`` now, ``VmHWM`` peak) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


class SendCounter:
    """Counts payload bytes of ``isend``/``irecv`` ops passed to ``dist.batch_isend_irecv``."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self._original = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._count

    def _count(self, ops):
        for op in ops:
            size = op.tensor.numel() * op.tensor.element_size()
            if op.op is dist.isend:
                self.sent += size
            else:
                self.received += size
        return self._original(ops)

    def take(self) -> tuple[int, int]:
        """``(sent, received)`` since the last call."""
        counts = (self.sent, self.received)
        self.sent = self.received = 0
        return counts


class KernelClock:
    """Thread CPU seconds spent inside ``longnet``'s block kernels, and what each call was
    (wraps ``kernels``' functions, which ``select_kernels`` looks up at call time)."""

    NAMES = ("cpu_flash_forward", "cpu_flash_backward", "math_forward", "math_backward")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls: list[tuple] = []
        for name in self.NAMES:
            setattr(kernels, name, self._timed(name, getattr(kernels, name)))

    def _timed(self, name: str, function):
        def timed(*args, **kwargs):
            self.calls.append(kernel_call(name, args))
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed

    def take(self) -> tuple[float, list[tuple]]:
        """Seconds and calls since the last call."""
        seconds, calls = self.seconds, self.calls
        self.seconds, self.calls = 0.0, []
        return seconds, calls


def kernel_call(name: str, args: tuple) -> tuple:
    """``(kernel name, dtype, q shape, k shape, causal, scale)`` of one block-kernel call
    (forward: ``q, k, v, causal, scale``; backward: ``d_out, q, k, v, out, lse, causal, scale``)."""
    q, k, _, causal, scale = args[:5] if name.endswith("forward") else args[1:4] + args[6:8]
    dtype = str(q.dtype).removeprefix("torch.")
    return name, dtype, tuple(q.shape), tuple(k.shape), causal, scale


def replay_seconds(calls: list[tuple]) -> float:
    """Thread CPU seconds of the recorded kernel ``calls`` re-run one after another in this
    process on one thread, on random blocks of the same shapes (the kernels' cost without other
    ranks competing for the cores; backward calls get the ``out``/``lse`` of a forward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seconds = 0.0
    try:
        for name, dtype, q_shape, k_shape, causal, scale in calls:
            forward = getattr(kernels, name.replace("backward", "forward"))
            q = torch.randn(q_shape, dtype=DTYPES[dtype])
            k, v = (torch.randn(k_shape, dtype=DTYPES[dtype]) for _ in range(2))
            if name.endswith("forward"):
                args = (q, k, v, causal, scale)
            else:
                out, lse = forward(q, k, v, causal, scale)
                args = (torch.randn_like(q), q, k, v, out, lse, causal, scale)
            start = time.thread_time()
            getattr(kernels, name)(*args)
            seconds += time.thread_time() - start
    finally:
        torch.set_num_threads(threads)
    return seconds


def attention_call(case: Case, q, k, v, group, seq_len: int, branches) -> torch.Tensor:
    """One forward call of ``case.system`` on local shards."""
    if case.system == "ours":
        return dilated_attention(
            q, k, v, branches, causal=case.causal, group=group, transport=case.transport
        )
    from ring_attention_pytorch import ring_flash_attn

    return ring_flash_attn(
        q,
        k,
        v,
        causal=case.causal,
        bucket_size=min(case.bucket_size, q.shape[1]),
        ring_reduce_col=group is not None,
    )


def _warm_up(case: Case, rank: int, world: int, group) -> None:
    """One small call of the same system, world and transport (loads code, sets up gloo pairs)."""
    seq = 256 * world
    dense = case.branches == ((case.seq_len, 1),)
    branches = ((seq, 1),) if dense else geometric_branches(seq, 256 // 2)
    shape = (case.batch, 256, case.heads, case.head_dim)
    q, k, v, grad = (torch.randn(shape).to(DTYPES[case.dtype]) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    attention_call(case, q, k, v, group, seq, branches).backward(grad)


def _prepared_inputs(case: Case, rank: int, world: int, group) -> tuple[list, int]:
    """Warm-up call, then this rank's q, k, v (requiring grad) and upstream gradient; also the
    RSS growth of the warm-up (code pages, gloo pairs)."""
    rss_start = _status_bytes("VmRSS")
    _warm_up(case, rank, world, group)
    warm_up_growth = _status_bytes("VmRSS") - rss_start
    q, k, v, grad = shard_inputs(case, rank, world)
    for t in (q, k, v):
        t.requires_grad_()
    return [q, k, v, grad], warm_up_growth


def memory_worker(rank: int, world: int, device: torch.device, case: Case) -> dict:
    """Worker body of a memory spawn (fixed mmap threshold): warm-up, then one forward +
    backward: peak RSS above the inputs, bytes sent and received, sampled output rows."""
    group = dist.group.WORLD if world > 1 else None
    counter = SendCounter()
    (q, k, v, grad), warm_up_growth = _prepared_inputs(case, rank, world, group)
    counter.take()
    dist.barrier()
    _reset_peak_rss()
    rss_before = _status_bytes("VmRSS")
    out = attention_call(case, q, k, v, group, case.seq_len, case.branches)
    sent_forward, received_forward = counter.take()
    out.backward(grad)
    peak = _status_bytes("VmHWM") - rss_before
    sent_backward, received_backward = counter.take()
    rows = [p - rank * q.shape[1] for p in case.check_rows if p // q.shape[1] == rank]
    return dict(
        rank=rank,
        peak_extra=peak,
        rss_before=rss_before,
        warm_up_growth=warm_up_growth,
        sent_forward=sent_forward,
        sent_backward=sent_backward,
        received_forward=received_forward,
        received_backward=received_backward,
        rows=rows,
        sample=out.detach()[0, rows].double().numpy() if rows else None,
    )


def timing_worker(rank: int, world: int, device: torch.device, case: Case) -> dict:
    """Worker body of a timing spawn (glibc's default allocator settings): warm-up, a first
    forward + backward, then ``timed_calls`` more; CPU, kernel and wall seconds of each, and the
    kernel calls of the last one."""
    group = dist.group.WORLD if world > 1 else None
    clock = KernelClock()
    (q, k, v, grad), _ = _prepared_inputs(case, rank, world, group)
    cpu_times, kernel_times, wall_times = [], [], []
    for _ in range(1 + case.timed_calls):
        for t in (q, k, v):
            t.grad = None
        dist.barrier()
        clock.take()
        cpu, wall = time.process_time(), time.perf_counter()
        attention_call(case, q, k, v, group, case.seq_len, case.branches).backward(grad)
        cpu_times.append(time.process_time() - cpu)
        wall_times.append(time.perf_counter() - wall)
        seconds, calls = clock.take()
        kernel_times.append(seconds)
    timed = slice(1, None) if case.timed_calls else slice(0, 1)  # else the first call stands in
    return dict(
        first_cpu=cpu_times[0],
        cpu=cpu_times[timed],
        kernel=kernel_times[timed],
        wall=wall_times[timed],
        kernel_calls=calls,
    )


def grad_worker(rank: int, world: int, device: torch.device, case: Case) -> dict:
    """out, dq, dk, dv of ``rank``'s shard (as float64 numpy arrays) for the gradient check."""
    group = dist.group.WORLD if world > 1 else None
    q, k, v, grad = shard_inputs(case, rank, world)
    for t in (q, k, v):
        t.requires_grad_()
    out = attention_call(case, q, k, v, group, case.seq_len, case.branches)
    out.backward(grad)
    return {
        name: t.detach().double().numpy()
        for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
    }


# --------------------------------------------------------------------------- parent side


@dataclass
class Result:
    """Every spawn of one case (lists over spawns of per-rank dicts) and derived numbers."""

    case: Case
    spawns: list[list[dict]] = field(default_factory=list)
    error: str | None = None
    max_error: float | None = None
    formula_peak: list[int] | None = None  # per rank, bytes
    formula_sent: list[tuple[int, int]] | None = None  # per rank, (forward, backward)
    kernels_alone: float | None = None  # all ranks' kernel calls replayed in one process, s

    def per_rank(self, key: str) -> list[float]:
        """Median over spawns of a per-rank scalar."""
        return [
            statistics.median(spawn[rank][key] for spawn in self.spawns)
            for rank in range(self.case.world)
        ]

    @property
    def peak_max(self) -> float:
        return max(self.per_rank("peak_extra"))

    def spawn_sums(self, key: str = "cpu") -> list[float]:
        """Per spawn: the sum over ranks of each rank's median ``key`` seconds."""
        return [sum(statistics.median(r[key]) for r in spawn) for spawn in self.spawns]

    def cpu_sum(self, key: str = "cpu") -> float:
        """Median over spawns of (sum over ranks of each rank's median CPU seconds)."""
        return statistics.median(self.spawn_sums(key))

    def paired_ratios(self, single: Result) -> list[float]:
        """Per spawn round: summed CPU / the single-device CPU of the same round (the cases run
        round-robin, so each pair ran minutes apart under similar machine load)."""
        return [a / b for a, b in zip(self.spawn_sums(), single.spawn_sums())]

    def first_cpu_sum(self) -> float:
        return statistics.median(sum(r["first_cpu"] for r in spawn) for spawn in self.spawns)

    def cpu_rank_max(self) -> float:
        return statistics.median(
            max(statistics.median(r["cpu"]) for r in spawn) for spawn in self.spawns
        )

    def wall(self) -> float:
        return statistics.median(
            max(statistics.median(r["wall"]) for r in spawn) for spawn in self.spawns
        )


def reference_rows(case: Case, rows: list[int]) -> torch.Tensor:
    """float64 ``softmax(q k^T * scale + log C) v`` at global query ``rows`` (batch 0)."""
    q, k, v, _ = global_inputs(case)
    pattern = DilatedPattern.coerce(case.branches)
    keys = torch.arange(case.seq_len)
    scale = case.head_dim**-0.5
    out = []
    for row in rows:
        counts = pattern.key_multiplicity(torch.tensor([row]), keys, case.heads, case.causal)[:, 0]
        scores = torch.einsum("hd,thd->ht", q[0, row], k[0]) * scale + counts.double().log()
        out.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v[0]))
    return torch.stack(out)


def sample_error(result: Result) -> float:
    """Max |out - ref| over the sampled rows of the first spawn."""
    spawn = result.spawns[0]
    rows, got = [], []
    for rank_result in spawn:
        if rank_result["sample"] is not None:
            rows += [
                p + rank_result["rank"] * result.case.seq_len // result.case.world
                for p in rank_result["rows"]
            ]
            got.append(torch.from_numpy(rank_result["sample"]))
    return (torch.cat(got) - reference_rows(result.case, rows)).abs().max().item()


def formula(case: Case) -> tuple[list[int], list[tuple[int, int]]]:
    """Per-rank peak extra bytes and (forward, backward) bytes sent from ``memory.py``."""
    setup = AttentionSetup(
        batch=case.batch,
        seq_len=case.seq_len,
        world_size=case.world,
        num_heads=case.heads,
        head_dim=case.head_dim,
        dtype=DTYPES[case.dtype],
        pattern=DilatedPattern.coerce(case.branches),
        causal=case.causal,
        transport=case.transport,
    )
    plan = plan_memory(setup)
    return (
        [r.peak_bytes for r in plan.ranks],
        [(r.sent_forward_bytes, r.sent_backward_bytes) for r in plan.ranks],
    )


def spawn_ranks(worker, case: Case, timeout: float, fixed_mmap: bool) -> list[dict]:
    """``worker`` on ``case.world`` fresh ranks; ``fixed_mmap``: with glibc's mmap threshold
    fixed (freed buffers leave the RSS: peak RSS = peak live bytes), else with the default,
    adaptive one (what users run with; freed buffers up to 32 MiB are reused, larger ones are
    mapped afresh)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by the spawned ranks
    try:
        return run_workers(worker, case.world, case, timeout=timeout)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def run_cases(cases: list[Case], spawns: int, timeout: float) -> list[Result]:
    """Every case ``spawns`` times (a memory spawn and a timing spawn of fresh processes each
    time), interleaved round-robin."""
    results = [Result(case) for case in cases]
    for spawn in range(spawns):
        for result in results:
            if result.error is not None:
                continue
            start = time.perf_counter()
            try:
                ranks = [
                    {**memory, **timing}
                    for memory, timing in zip(
                        spawn_ranks(memory_worker, result.case, timeout, fixed_mmap=True),
                        spawn_ranks(timing_worker, result.case, timeout, fixed_mmap=False),
                    )
                ]
            except Exception as error:  # record why a system cannot run here
                result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
                print(f"[spawn {spawn}] {result.case.label}: FAILED {result.error}", flush=True)
                continue
            result.spawns.append(ranks)
            peak = max(r["peak_extra"] for r in ranks) / MIB
            cpu = sum(statistics.median(r["cpu"]) for r in ranks)
            print(
                f"[spawn {spawn}] {result.case.label}: peak extra {peak:.1f} MiB/rank (max), "
                f"cpu sum {cpu:.2f} s, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    for result in results:
        if result.spawns:
            result.max_error = sample_error(result)
            if result.case.system == "ours":
                result.formula_peak, result.formula_sent = formula(result.case)
    return results


def replay_kernels(results: list[Result], rounds: int) -> None:
    """Set ``kernels_alone`` of every ``ours`` result: the block-kernel calls of all its ranks
    (as recorded in its first timing spawn) re-run one after another here, median over
    ``rounds`` rounds that interleave the results. Against the measured kernel seconds this
    separates the cost of the ring's block shapes from that of P one-thread ranks sharing the
    machine's cores."""
    replayed = [r for r in results if r.spawns and r.case.system == "ours"]
    seconds: dict[int, list[float]] = {id(r): [] for r in replayed}
    for round_ in range(rounds):
        for result in replayed:
            total = sum(replay_seconds(rank["kernel_calls"]) for rank in result.spawns[0])
            seconds[id(result)].append(total)
            print(f"[replay {round_}] {result.case.label}: kernels alone {total:.2f} s", flush=True)
    for result in replayed:
        result.kernels_alone = statistics.median(seconds[id(result)])


def gradient_check(base: Case, worlds: list[int], timeout: float) -> list[dict]:
    """out/dq/dk/dv max errors of both systems vs float64 SDPA (dense, small)."""
    rows = []
    for system, dtype in (
        ("ours", "float64"),
        ("ours", "float32"),
        ("ring-attention-pytorch", "float32"),
        ("ring-attention-pytorch", "float64"),
    ):
        for world in worlds:
            case = Case(**{**asdict(base), "system": system, "world": world, "dtype": dtype})
            case = Case(**{**asdict(case), "branches": ((case.seq_len, 1),)})
            try:
                ranks = run_workers(grad_worker, world, case, timeout=timeout)
            except Exception as error:
                rows.append(
                    dict(
                        system=system,
                        world=world,
                        dtype=dtype,
                        error=str(error).strip().splitlines()[-1][:160],
                    )
                )
                continue
            q, k, v, grad = (t.clone().requires_grad_() for t in global_inputs(case))
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=case.causal
            ).transpose(1, 2)
            ref.backward(grad.detach())
            refs = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            row = dict(system=system, world=world, dtype=dtype)
            for name, expected in refs.items():
                got = torch.cat([torch.from_numpy(r[name]) for r in ranks], dim=1)
                row[name] = (got - expected).abs().max().item()
            rows.append(row)
            print(f"grad check {system} P={world} {dtype}: {row}", flush=True)
    return rows


# --------------------------------------------------------------------------- reporting


def fmt_mib(count: float | None) -> str:
    return "-" if count is None else f"{count / MIB:.1f}"


def main_rows(results: list[Result]) -> list[dict]:
    """Table rows of the dilated cases of ``ours`` with ratios to the single-device run."""
    single = next(r for r in results if r.case.world == 1 and r.spawns)
    rows = []
    for result in results:
        if not result.spawns:
            rows.append(
                dict(P=result.case.world, transport=result.case.transport, error=result.error)
            )
            continue
        peaks = result.per_rank("peak_extra")
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        formula_peak = result.formula_peak[worst]
        sent_f = max(result.per_rank("sent_forward"))
        sent_b = max(result.per_rank("sent_backward"))
        formula_f = max(f for f, _ in result.formula_sent)
        formula_b = max(b for _, b in result.formula_sent)
        deviations = [m / f - 1 for m, f in zip(peaks, result.formula_peak)]
        rows.append(
            dict(
                P=result.case.world,
                transport="-" if result.case.world == 1 else result.case.transport,
                peak_mib=peaks[worst] / MIB,
                peak_min_mib=min(peaks) / MIB,
                formula_mib=formula_peak / MIB,
                vs_formula=max(deviations, key=abs),
                vs_single=peaks[worst] / single.peak_max,
                cpu_rank_max=result.cpu_rank_max(),
                cpu_sum=result.cpu_sum(),
                kernel_sum=result.cpu_sum("kernel"),
                kernels_alone=result.kernels_alone,
                kernels_alone_vs_single=result.kernels_alone / single.kernels_alone,
                cpu_vs_single=statistics.median(result.paired_ratios(single)),
                cpu_ratio_range=(
                    min(result.paired_ratios(single)),
                    max(result.paired_ratios(single)),
                ),
                first_cpu_vs_single=result.first_cpu_sum() / single.first_cpu_sum(),
                wall=result.wall(),
                sent_forward_mib=sent_f / MIB,
                sent_backward_mib=sent_b / MIB,
                sent_matches=(sent_f, sent_b) == (formula_f, formula_b),
                max_error=result.max_error,
                spawns=len(result.spawns),
            )
        )
    return rows


def dense_rows(results: list[Result]) -> list[dict]:
    rows = []
    for result in results:
        if not result.spawns:
            rows.append(dict(system=result.case.system, P=result.case.world, error=result.error))
            continue
        rows.append(
            dict(
                system=result.case.system,
                P=result.case.world,
                peak_mib=result.peak_max / MIB,
                formula_mib=max(result.formula_peak) / MIB if result.formula_peak else None,
                cpu_sum=result.cpu_sum(),
                wall=result.wall(),
                sent_mib=(
                    max(result.per_rank("sent_forward")) + max(result.per_rank("sent_backward"))
                )
                / MIB,
                max_error=result.max_error,
            )
        )
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main_table(rows: list[dict]) -> str:
    header = [
        "P",
        "transport",
        "peak extra MiB/rank (max; min)",
        "formula MiB",
        "measured vs formula",
        "vs P=1",
        "CPU s/rank (max)",
        "CPU s summed over ranks (kernels; rest)",
        "vs single device: paired median (range; first call)",
        "kernels alone s (vs P=1)",
        "wall s",
        "sent MiB/rank fwd; bwd",
        "= formula",
        "max err vs fp64",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r["P"]), r["transport"], r["error"]] + [""] * (len(header) - 3))
            continue
        body.append(
            [
                str(r["P"]),
                r["transport"],
                f"{r['peak_mib']:.1f}; {r['peak_min_mib']:.1f}",
                f"{r['formula_mib']:.1f}",
                f"{r['vs_formula']:+.1%}",
                f"{r['vs_single']:.3f}",
                f"{r['cpu_rank_max']:.2f}",
                f"{r['cpu_sum']:.2f} ({r['kernel_sum']:.2f}; {r['cpu_sum'] - r['kernel_sum']:.2f})",
                f"{r['cpu_vs_single']:.2f}x ({r['cpu_ratio_range'][0]:.2f}-"
                f"{r['cpu_ratio_range'][1]:.2f}; {r['first_cpu_vs_single']:.2f}x)",
                f"{r['kernels_alone']:.2f} ({r['kernels_alone_vs_single']:.2f}x)",
                f"{r['wall']:.1f}",
                f"{r['sent_forward_mib']:.2f}; {r['sent_backward_mib']:.2f}",
                "yes" if r["sent_matches"] else "NO",
                f"{r['max_error']:.1e}",
            ]
        )
    return markdown_table(header, body)


def dense_table(rows: list[dict]) -> str:
    header = [
        "system",
        "P",
        "peak extra MiB/rank (max)",
        "formula MiB",
        "CPU s summed",
        "wall s",
        "sent MiB/rank fwd+bwd",
        "out max err vs fp64",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["system"], str(r["P"]), r["error"]] + [""] * 5)
            continue
        body.append(
            [
                r["system"],
                str(r["P"]),
                f"{r['peak_mib']:.1f}",
                "-" if r["formula_mib"] is None else f"{r['formula_mib']:.1f}",
                f"{r['cpu_sum']:.2f}",
                f"{r['wall']:.1f}",
                f"{r['sent_mib']:.2f}",
                f"{r['max_error']:.1e}",
            ]
        )
    return markdown_table(header, body)


def grad_table(rows: list[dict]) -> str:
    header = ["system", "inputs", "P", "out", "dq", "dk", "dv"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["system"], r["dtype"], str(r["world"]), r["error"], "", "", ""])
            continue
        body.append(
            [r["system"], r["dtype"], str(r["world"])]
            + [f"{r[k]:.1e}" for k in ("out", "dq", "dk", "dv")]
        )
    return markdown_table(header, body)


def plot(rows_by_transport: dict[str, list[dict]], path: Path, title: str) -> None:
    """Per-rank peak extra memory and summed CPU time vs P, one line per transport; where the
    CPU time of the first transport goes (kernels inside the ranks, the same kernel calls
    replayed alone, everything else)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, cpu_ax, parts_ax) = plt.subplots(1, 3, figsize=(16, 4.2))
    single = next(r for rows in rows_by_transport.values() for r in rows if r["P"] == 1)
    for transport, rows in rows_by_transport.items():
        rows = [r for r in rows if "error" not in r]
        ps = [r["P"] for r in rows]
        mem_ax.plot(ps, [r["peak_mib"] for r in rows], "o-", label=f"{transport}: measured")
        mem_ax.plot(ps, [r["formula_mib"] for r in rows], "x--", label=f"{transport}: formula")
        cpu_ax.plot(ps, [r["cpu_sum"] for r in rows], "o-", label=f"{transport}: summed over ranks")
    ps = sorted({r["P"] for rows in rows_by_transport.values() for r in rows})
    mem_ax.plot(ps, [single["peak_mib"] / p for p in ps], ":", color="gray", label="P=1 / P")
    cpu_ax.axhline(single["cpu_sum"], color="gray", ls=":", label="single device")
    cpu_ax.axhline(1.15 * single["cpu_sum"], color="red", ls=":", label="target 1.15x")
    for ax, ylabel in (
        (mem_ax, "peak extra memory per rank (MiB)"),
        (cpu_ax, "CPU seconds, fwd+bwd"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.set_xlabel("ranks P")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mem_ax.set_yscale("log")
    transport, rows = next(iter(rows_by_transport.items()))
    rows = [r for r in rows if "error" not in r]
    parts = {
        "block kernels, inside the ranks": [r["kernel_sum"] for r in rows],
        "same kernel calls, replayed alone": [r["kernels_alone"] for r in rows],
        "rest (gathers, merges, packing, communication)": [
            r["cpu_sum"] - r["kernel_sum"] for r in rows
        ],
    }
    width = 0.8 / len(parts)
    for i, (label, seconds) in enumerate(parts.items()):
        offset = (i - (len(parts) - 1) / 2) * width
        parts_ax.bar([j + offset for j in range(len(rows))], seconds, width, label=label)
    parts_ax.set_xticks(range(len(rows)), [str(r["P"]) for r in rows])
    parts_ax.set_xlabel(f"ranks P ({transport})")
    parts_ax.set_ylabel("CPU seconds summed over ranks")
    parts_ax.set_ylim(0, 1.45 * max(max(seconds) for seconds in parts.values()))  # legend room
    parts_ax.grid(alpha=0.3, axis="y")
    parts_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"`{platform.platform()}`, {os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )


def code_version() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "longnet/attention").strip()
    return f"commit {commit}" + (", longnet/attention with uncommitted changes" if dirty else "")


def markers(name: str) -> tuple[str, str]:
    """The begin/end comments around the generated block ``name`` of our section."""
    return f"<!-- bench_ring:{name}:begin -->", f"<!-- bench_ring:{name}:end -->"


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, evaluated on the measured rows."""
    lines = []
    for row in rows:
        if "error" in row or row["P"] == 1:
            continue
        name = f"P={row['P']} {row['transport']}"
        if row["P"] == 4:
            verdict = "met" if row["vs_single"] <= 0.30 else "NOT met"
            lines.append(
                f"memory {name}: per-rank peak extra = {row['vs_single']:.3f}x P=1 "
                f"(target <= 0.30, ideal 0.25): {verdict}"
            )
        verdict = "met" if row["cpu_vs_single"] <= 1.15 else "NOT met"
        low, high = row["cpu_ratio_range"]
        lines.append(
            f"CPU {name}: summed over ranks = {row['cpu_vs_single']:.2f}x single device "
            f"(median of per-round ratios, range {low:.2f}-{high:.2f}; first call "
            f"{row['first_cpu_vs_single']:.2f}x; target <= 1.15x): {verdict}"
        )
    worst = max((r for r in rows if "error" not in r), key=lambda r: abs(r["vs_formula"]))
    verdict = "met" if abs(worst["vs_formula"]) <= 0.15 else "NOT met"
    lines.append(
        f"formula vs measured peak: worst {worst['vs_formula']:+.1%} (P={worst['P']} "
        f"{worst['transport']}; target within 15%): {verdict}"
    )
    return lines


def run_lines(run: dict) -> list[str]:
    return [
        f"- command: `{run['command']}`",
        f"- date: {run['date']}; wall time of the run {run['wall']:.0f} s; load average (1 min) "
        f"at start {run['load'][0]:.2f}, at end {run['load'][1]:.2f}",
        f"- machine: {machine()}; each rank one thread; gloo over loopback",
        f"- code: {code_version()}",
    ]


def generated_blocks(args, run: dict, rows: list[dict], dense: list[dict], grads: list[dict]):
    """``{block name: markdown}`` for the parts this run measured."""
    case = run["case"]
    blocks = {}
    if rows:
        blocks[args.block] = [
            f"**N = {case.seq_len}**, batch {case.batch}, {case.heads} heads, head_dim "
            f"{case.head_dim}, {case.dtype}, causal={case.causal}; pattern (w, r) = "
            f"{list(case.branches)}; {args.spawns} fresh spawns per configuration (medians), "
            f"{args.timed_calls} timed calls per spawn.",
            "",
            *run_lines(run),
            "",
            "Targets:",
            "",
            *[f"- {line}" for line in targets(rows)],
            "",
            main_table(rows),
            "",
            f"![memory and CPU time vs P]({run['plot']})",
        ]
    if dense:
        blocks["dense"] = [
            f"**Dense ring at N = {args.dense_seq_len}** (ours: pattern [(N, 1)]; "
            f"ring-attention-pytorch {run['ring_attention_version']}: `ring_flash_attn(q, k, v, "
            f"causal=True, bucket_size={args.bucket_size}, ring_reduce_col=P > 1)`), "
            f"{args.dense_spawns} spawn(s), {case.heads} heads, head_dim {case.head_dim}, "
            f"{case.dtype}:",
            "",
            *run_lines(run),
            "",
            dense_table(dense),
        ]
    if grads:
        blocks["grads"] = [
            f"**Gradient check**, dense causal, N = {args.grad_seq_len}, batch 1, {args.heads} "
            f"heads, head_dim {args.head_dim}: max |error| vs float64 SDPA (inputs rounded to "
            "the input dtype first):",
            "",
            *run_lines(run),
            "",
            grad_table(grads),
        ]
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def write_blocks(path: Path, blocks: dict[str, str]) -> None:
    """Replace each generated block between its markers; a new block goes to the end of our
    section (created if missing). Text outside the markers is kept; the file is re-read right
    before writing."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if "\n" + SECTION not in text:
        text = text.rstrip("\n") + "\n\n" + SECTION + "\n"
    for name, block in blocks.items():
        begin, end = markers(name)
        wrapped = f"{begin}\n{block}\n{end}"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + wrapped + rest.split(end, 1)[1]
            continue
        start = text.index("\n" + SECTION)
        following = text.find("\n## ", start + 1)
        cut = len(text) if following < 0 else following
        text = text[:cut].rstrip("\n") + "\n\n" + wrapped + "\n" + text[cut:]
    path.write_text(text.rstrip("\n") + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--base-segment", type=int, default=2048)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--transports", nargs="+", default=["ring", "allgather"])
    parser.add_argument("--bidirectional", action="store_true", help="non-causal attention")
    parser.add_argument("--spawns", type=int, default=2, help="fresh process groups per case")
    parser.add_argument("--timed-calls", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=32)
    parser.add_argument(
        "--replay-rounds", type=int, default=3, help="rounds of the kernel replay (median)"
    )
    parser.add_argument("--dense-seq-len", type=int, default=8192, help="0: skip the dense run")
    parser.add_argument("--dense-spawns", type=int, default=1)
    parser.add_argument("--bucket-size", type=int, default=1024)
    parser.add_argument("--grad-seq-len", type=int, default=512, help="0: skip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--block", default="main", help="name of the generated main block")
    parser.add_argument("--no-doc", action="store_true", help="do not touch benchmarks.md")
    args = parser.parse_args(argv)
    if args.replay_rounds < 1:
        parser.error("--replay-rounds must be at least 1")
    return args


def build_cases(args) -> tuple[list[Case], list[Case]]:
    def case(system, world, transport, seq_len, branches) -> Case:
        return Case(
            system=system,
            world=world,
            transport=transport,
            seq_len=seq_len,
            branches=branches,
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
            causal=not args.bidirectional,
            seed=args.seed,
            check_rows=check_rows(seq_len, args.check_rows, args.seed),
            timed_calls=args.timed_calls,
            bucket_size=args.bucket_size,
        )

    n = args.seq_len
    branches = geometric_branches(n, args.base_segment)
    main = [case("ours", 1, args.transports[0], n, branches)]
    main += [case("ours", p, t, n, branches) for t in args.transports for p in args.worlds if p > 1]
    dense = []
    if args.dense_seq_len:
        m = args.dense_seq_len
        for p in args.worlds:
            dense += [
                case("ours", p, "ring", m, ((m, 1),)),
                case("ring-attention-pytorch", p, "ring", m, ((m, 1),)),
            ]
    return main, dense


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    main_cases, dense_cases = build_cases(args)
    results = run_cases(main_cases, args.spawns, args.timeout)
    replay_kernels(results, args.replay_rounds)
    dense_results = run_cases(dense_cases, args.dense_spawns, args.timeout)
    grads = []
    if args.grad_seq_len:
        base = Case(**{**asdict(main_cases[0]), "seq_len": args.grad_seq_len})
        grads = gradient_check(base, args.worlds, args.timeout)
    rows = main_rows(results)
    by_transport = {t: [r for r in rows if r.get("transport") in (t, "-")] for t in args.transports}
    dense = dense_rows(dense_results)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.block == "main" else f"_{args.block}"
    plot_path = args.out / f"bench_ring{suffix}.png"
    title = (
        f"dilated attention, N={args.seq_len}, {args.heads} heads x {args.head_dim}, "
        f"{args.dtype}, {'bidirectional' if args.bidirectional else 'causal'}, fwd+bwd"
    )
    plot(by_transport, plot_path, title)
    print(
        main_table(rows),
        "",
        dense_table(dense) if dense else "",
        "",
        grad_table(grads) if grads else "",
        "",
        *targets(rows),
        sep="\n",
    )
    try:
        from importlib.metadata import version

        ring_version = version("ring-attention-pytorch")
    except Exception:  # not installed
        ring_version = "not installed"
    run = dict(
        command="python "
        + " ".join(
            shlex.quote(a) for a in [f"scripts/{Path(__file__).name}", *(argv or sys.argv[1:])]
        ),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        wall=time.perf_counter() - start,
        load=(load_start, os.getloadavg()[0]),
        case=main_cases[0],
        plot=plot_path.name,
        ring_attention_version=ring_version,
    )
    if not args.no_doc:
        write_blocks(args.out / "benchmarks.md", generated_blocks(args, run, rows, dense, grads))
        print(f"updated {args.out / 'benchmarks.md'} ({SECTION})")
    if args.json:
        samples = [
            dict(
                case=asdict(r.case),
                error=r.error,
                max_error=r.max_error,
                formula_peak=r.formula_peak,
                formula_sent=r.formula_sent,
                spawns=[
                    [
                        {k: v for k, v in rank.items() if k not in ("sample", "kernel_calls")}
                        for rank in s
                    ]
                    for s in r.spawns
                ],
            )
            for r in results + dense_results
        ]
        args.json.write_text(
            json.dumps(
                dict(rows=rows, dense=dense, grads=grads, samples=samples), indent=1, default=str
            )
        )


if __name__ == "__main__":
    main()
