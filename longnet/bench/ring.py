"""The sequence-parallel ring benchmark behind ``scripts/bench_ring.py``: cases, the rank
workers, the parent's aggregation, tables, plot and the generated blocks of the
``## Sequence-parallel ring`` section of ``docs/benchmarks.md`` (which defines every column).

Measurement, per case in freshly spawned gloo processes (``longnet.distributed.run_workers``,
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

The formula columns come from ``longnet.planning`` for the same setup.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from longnet.attention import DilatedPattern, dilated_attention
from longnet.bench.common import (
    DTYPES,
    MIB,
    fixed_malloc,
    log2_axis,
    markdown_table,
    pyplot,
    reference_rows,
    run_lines,
    sample_rows,
    save_figure,
    sdpa,
)
from longnet.bench.instrument import KernelClock, SendCounter, replay_seconds
from longnet.bench.peers import ring_flash_attention
from longnet.distributed import run_workers
from longnet.planning import AttentionSetup, plan_memory
from longnet.training.rank_memory import reset_peak_rss, status_bytes

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
        return dilated_attention(
            q, k, v, branches, causal=case.causal, process_group=group, transport=case.transport
        )
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


# --------------------------------------------------------------------------- reporting


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
        sent_f = max(result.per_rank("sent_forward"))
        sent_b = max(result.per_rank("sent_backward"))
        formula_f = max(f for f, _ in result.formula_sent)
        formula_b = max(b for _, b in result.formula_sent)
        deviations = [m / f - 1 for m, f in zip(peaks, result.formula_peak)]
        ratios = result.paired_ratios(single)
        rows.append(
            dict(
                P=result.case.world,
                transport="-" if result.case.world == 1 else result.case.transport,
                peak_mib=peaks[worst] / MIB,
                peak_min_mib=min(peaks) / MIB,
                formula_mib=result.formula_peak[worst] / MIB,
                vs_formula=max(deviations, key=abs),
                vs_single=peaks[worst] / single.peak_max,
                cpu_rank_max=result.cpu_rank_max(),
                cpu_sum=result.cpu_sum(),
                kernel_sum=result.cpu_sum("kernel"),
                kernels_alone=result.kernels_alone,
                kernels_alone_vs_single=result.kernels_alone / single.kernels_alone,
                cpu_vs_single=statistics.median(ratios),
                cpu_ratio_range=(min(ratios), max(ratios)),
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


def _table(header: list[str], rows: list[dict], lead: tuple[str, ...], cells) -> str:
    """``rows`` as a markdown table: ``cells(row)`` each, or the ``lead`` columns and the
    error for a row that failed."""
    body = [
        [str(r[key]) for key in lead] + [r["error"]] + [""] * (len(header) - len(lead) - 1)
        if "error" in r
        else cells(r)
        for r in rows
    ]
    return markdown_table(header, body)


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
    return _table(
        header,
        rows,
        ("P", "transport"),
        lambda r: [
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
        ],
    )


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
    return _table(
        header,
        rows,
        ("system", "P"),
        lambda r: [
            r["system"],
            str(r["P"]),
            f"{r['peak_mib']:.1f}",
            "-" if r["formula_mib"] is None else f"{r['formula_mib']:.1f}",
            f"{r['cpu_sum']:.2f}",
            f"{r['wall']:.1f}",
            f"{r['sent_mib']:.2f}",
            f"{r['max_error']:.1e}",
        ],
    )


def grad_table(rows: list[dict]) -> str:
    header = ["system", "inputs", "P", "out", "dq", "dk", "dv"]
    return _table(
        header,
        rows,
        ("system", "dtype", "world"),
        lambda r: (
            [r["system"], r["dtype"], str(r["world"])]
            + [f"{r[k]:.1e}" for k in ("out", "dq", "dk", "dv")]
        ),
    )


def plot(rows_by_transport: dict[str, list[dict]], path: Path, title: str) -> None:
    """Per-rank peak extra memory and summed CPU time vs P, one line per transport; where the
    CPU time of the first transport goes (kernels inside the ranks, the same kernel calls
    replayed alone, everything else)."""
    plt = pyplot()
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
    log2_axis(mem_ax, "ranks P", "peak extra memory per rank (MiB)", ticks=ps, log_y=True)
    log2_axis(cpu_ax, "ranks P", "CPU seconds, fwd+bwd", ticks=ps)
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
    save_figure(fig, path, title, dpi=120)


def generated_blocks(
    args, run: dict, code: str, rows: list[dict], dense: list[dict], grads: list[dict]
) -> dict[str, str]:
    """``{block name: markdown}`` for the parts this run measured (``args``: the script's)."""
    case = run["case"]
    head = [
        *run_lines(run, run["machine"] + "; each rank one thread; gloo over loopback", code),
        "",
    ]
    blocks = {}
    if rows:
        blocks[args.block] = [
            f"**N = {case.seq_len}**, batch {case.batch}, {case.heads} heads, head_dim "
            f"{case.head_dim}, {case.dtype}, causal={case.causal}; pattern (w, r) = "
            f"{list(case.branches)}; {args.spawns} fresh spawns per configuration (medians), "
            f"{args.timed_calls} timed calls per spawn.",
            "",
            *head,
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
            *head,
            dense_table(dense),
        ]
    if grads:
        blocks["grads"] = [
            f"**Gradient check**, dense causal, N = {args.grad_seq_len}, batch 1, {args.heads} "
            f"heads, head_dim {args.head_dim}: max |error| vs float64 SDPA (inputs rounded to "
            "the input dtype first):",
            "",
            *head,
            grad_table(grads),
        ]
    return {name: "\n".join(lines) for name, lines in blocks.items()}
