"""The reports of the sequence-parallel ring benchmark (``lab/bench/ring.py`` measures):
rows with ratios to the single-device run, the markdown tables, the plot, and the generated
blocks of the ``## Sequence-parallel ring`` section of ``docs/benchmarks.md``."""

from __future__ import annotations

import statistics
from pathlib import Path

from lab.bench.common import MIB, log2_axis, markdown_table, pyplot, run_lines, save_figure
from lab.bench.ring import Result


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
