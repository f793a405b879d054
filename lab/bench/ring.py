"""The sequence-parallel ring benchmark behind ``lab/scripts/bench_ring.py``: cases, the rank
workers and the parent's aggregation (``ring_report.py`` turns the results into the tables,
the plot and the blocks of the ``## Sequence-parallel ring`` section of ``docs/benchmarks.md``,
which defines every column).

Measurement, per case in freshly spawned gloo processes (``lab.workers.run_workers``,
one thread each), ``--spawns`` times, configurations interleaved; every time two spawns, each
starting with a warm-up call of the same system at ``256 * P`` tokens:

* memory spawn: once q, k, v and the upstream gradient exist, the peak RSS mark (``VmHWM``) is
  reset via ``/proc/self/clear_refs``; one call; **peak extra memory** = ``VmHWM`` minus the
  RSS right before the call, with glibc's mmap threshold fixed at 128 KiB (``MALLOC_FIXED``)
  so freed buffers leave the RSS (as in the single-device benchmark). Bytes sent = payload
  bytes of every ``isend`` passed to ``torch.distributed.batch_isend_irecv`` (``SendCounter``;
  the 16-byte argument check ``all_reduce`` and ``ring-attention-pytorch``'s barriers are not
  counted).
* timing spawn, with glibc's default (adaptive) allocator settings, as users run (the fixed
  threshold maps every buffer above 128 KiB afresh and pays its page faults on every call; the
  default reuses freed buffers up to its 32 MiB ceiling and maps only larger ones afresh).
  CPU time = ``time.process_time()`` (all threads of the rank) of ``--timed-calls`` calls after
  a first one, median per rank, summed over ranks; kernel seconds by ``KernelClock``.
* kernel replay, after all spawns: the block-kernel calls every rank made in its last timed
  call (name, dtype, block shapes, causal flag; from the first timing spawn) re-run one after
  another in this process on one thread, on random blocks of the same shapes, summed over
  ranks, median of ``--replay-rounds`` interleaved rounds: the kernels' cost for the ring's
  block shapes without P ranks competing for the machine's cores.

The formula columns come from ``lab.memory`` for the same setup.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from lab.bench.common import (
    DTYPES,
    MIB,
    fixed_malloc,
    reference_rows,
    sample_rows,
    sdpa,
)
from lab.bench.instrument import KernelClock, SendCounter, replay_seconds
from lab.bench.peers import ring_flash_attention
from lab.memory import AttentionSetup, plan_memory
from lab.workers import run_workers
from longnet.attention import DilatedPattern, dilated_attention
from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.training.reports import reset_peak_rss, status_bytes

SECTION = "## Sequence-parallel ring"
PREFIX = "bench_ring"
"""Markers of the generated blocks: ``<!-- bench_ring:<block>:begin -->`` ... ``:end -->``."""

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
    return sample_rows(seq_len, count, seed)


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


def attention_call(case: Case, q, k, v, group, branches) -> torch.Tensor:
    """One forward call of ``case.system`` on local shards."""
    if case.system == "ours":
        split = None if group is None else SequenceParallel(group, transport=case.transport)
        return dilated_attention(q, k, v, branches, causal=case.causal, sequence_parallel=split)
    return ring_flash_attention(q, k, v, case.causal, case.bucket_size, ring=group is not None)


def _warm_up(case: Case, world: int, group) -> None:
    """One small call of the same system, world and transport (loads code, sets up gloo pairs)."""
    seq = 256 * world
    dense = case.branches == ((case.seq_len, 1),)
    branches = ((seq, 1),) if dense else geometric_branches(seq, 256 // 2)
    shape = (case.batch, 256, case.heads, case.head_dim)
    q, k, v, grad = (torch.randn(shape).to(DTYPES[case.dtype]) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    attention_call(case, q, k, v, group, branches).backward(grad)


def _prepared_inputs(case: Case, rank: int, world: int, group) -> tuple[list, int]:
    """Warm-up call, then this rank's q, k, v (requiring grad) and upstream gradient; also the
    RSS growth of the warm-up (code pages, gloo pairs)."""
    rss_start = status_bytes("VmRSS")
    _warm_up(case, world, group)
    warm_up_growth = status_bytes("VmRSS") - rss_start
    q, k, v, grad = shard_inputs(case, rank, world)
    for t in (q, k, v):
        t.requires_grad_()
    return [q, k, v, grad], warm_up_growth


def memory_worker(rank: int, world: int, device: torch.device, case: Case) -> dict:
    """Worker body of a memory spawn (fixed mmap threshold): warm-up, then one forward +
    backward: peak RSS above the inputs, bytes sent and received, sampled output rows."""
    group = dist.group.WORLD if world > 1 else None
    with SendCounter() as counter:
        (q, k, v, grad), warm_up_growth = _prepared_inputs(case, rank, world, group)
        counter.take()
        dist.barrier()
        if not reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
        rss_before = status_bytes("VmRSS")
        out = attention_call(case, q, k, v, group, case.branches)
        sent_forward, received_forward = counter.take()
        out.backward(grad)
        peak = status_bytes("VmHWM") - rss_before
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
    cpu_times, kernel_times, wall_times = [], [], []
    with KernelClock() as clock:
        (q, k, v, grad), _ = _prepared_inputs(case, rank, world, group)
        for _ in range(1 + case.timed_calls):
            for t in (q, k, v):
                t.grad = None
            dist.barrier()
            clock.take()
            cpu, wall = time.process_time(), time.perf_counter()
            attention_call(case, q, k, v, group, case.branches).backward(grad)
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
    out = attention_call(case, q, k, v, group, case.branches)
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

    def samples(self) -> dict:
        """Everything measured, for ``--json`` (without output rows and kernel calls)."""
        return dict(
            case=asdict(self.case),
            error=self.error,
            max_error=self.max_error,
            formula_peak=self.formula_peak,
            formula_sent=self.formula_sent,
            spawns=[
                [
                    {k: v for k, v in rank.items() if k not in ("sample", "kernel_calls")}
                    for rank in spawn
                ]
                for spawn in self.spawns
            ],
        )


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
    case = result.case
    q, k, v, _ = global_inputs(case)
    pattern = DilatedPattern.coerce(case.branches)
    expected = reference_rows(q, k, v, pattern, rows, case.causal)
    return (torch.cat(got) - expected).abs().max().item()


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
    """``worker`` on ``case.world`` fresh ranks; ``fixed_mmap``: under ``MALLOC_FIXED`` (freed
    buffers leave the RSS: peak RSS = peak live bytes), else with glibc's default, adaptive
    settings (what users run with; freed buffers up to 32 MiB are reused, larger ones are
    mapped afresh)."""
    with fixed_malloc(fixed_mmap):  # inherited by the spawned ranks
        return run_workers(worker, case.world, case, timeout=timeout)


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
            case = Case(
                **{
                    **asdict(base),
                    "system": system,
                    "world": world,
                    "dtype": dtype,
                    "branches": ((base.seq_len, 1),),
                }
            )
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
            ref = sdpa(q, k, v, case.causal)
            ref.backward(grad.detach())
            refs = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            row = dict(system=system, world=world, dtype=dtype)
            for name, expected in refs.items():
                got = torch.cat([torch.from_numpy(r[name]) for r in ranks], dim=1)
                row[name] = (got - expected).abs().max().item()
            rows.append(row)
            print(f"grad check {system} P={world} {dtype}: {row}", flush=True)
    return rows
