"""Load balance of the causal sequence-parallel training step: contiguous against zigzag shards.

    python -m lab.scripts.bench_load_balance --model longnet-tiny-16k --seq-len 16384 --worlds 2 4 \
        --steps 3 --update-docs

For each world size ``P`` and each layout, ``P`` gloo processes (one thread each) run training
steps of the zoo model on one sequence of ``--seq-len`` random bytes (how each number is
measured: ``lab/bench/balance.py``). Reported per rank: busy seconds per step and the share
of the step it waited; per run: the step's wall time (median) and the busiest rank's time over
the mean (1.00 is perfect balance). With ``P`` above the number of cores the ranks also share
cores, so their wall times stretch; busy times and their balance still compare.

Outputs: a table on stdout, ``<out>/bench_load_balance.png`` (busy and waiting time of every
rank) and the ``load-balance`` block of the ``## Sequence-parallel ring`` section of
``<out>/benchmarks.md`` (replaced between its markers); ``--json PATH`` every sample. ``--out``
defaults to ``runs/bench_load_balance``; ``--update-docs`` writes into the repository's
``docs/`` instead. Every output is checked before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from lab.bench import common
from lab.bench.balance import RankSteps, step_worker
from lab.bench.ring import SECTION
from lab.scripts.arguments import ScriptParser, run_cli
from lab.workers import run_workers
from longnet.cli.arguments import (
    float_argument,
    length_argument,
    non_negative_int_argument,
    positive_int_argument,
)
from longnet.distributed.layouts import LAYOUTS
from longnet.modeling.zoo import ZOO

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "bench_load_balance"
HEADER = ["P", "layout", "step s (wall)", "speed-up vs contiguous", "busy s per rank",
          "waiting share per rank", "busiest / mean"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="longnet-tiny-16k", choices=sorted(ZOO))
    parser.add_argument("--seq-len", type=length_argument, default=16384)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=positive_int_argument, default=3,
                        help="timed steps after one warm-up")
    parser.add_argument("--seed", type=non_negative_int_argument, default=0)
    parser.add_argument("--timeout", type=float_argument(0, exclusive=True), default=3600.0,
                        help="seconds per run")
    common.add_output_arguments(parser, "bench_load_balance")
    args = parser.parse_args(argv)
    if any(world < 2 for world in args.worlds):
        parser.error(f"--worlds: sequence parallelism needs 2 ranks or more, got {args.worlds}")
    return args


def step_wall(ranks: list[RankSteps]) -> float:
    """Median over the timed steps of the slowest rank's wall time."""
    return statistics.median(max(steps) for steps in zip(*(r.wall for r in ranks)))


def run_rows(results: dict[tuple[int, str], list[RankSteps]]) -> list[list[str]]:
    """Table rows of ``HEADER``, one per ``(P, layout)``."""
    rows = []
    for (world, layout), ranks in results.items():
        wall, base_wall = step_wall(ranks), step_wall(results[world, "contiguous"])
        busy = [r.busy_median for r in ranks]
        rows.append([
            str(world), layout, f"{wall:.2f}", f"{base_wall / wall:.2f}x",
            " / ".join(f"{b:.2f}" for b in busy),
            " / ".join(f"{r.idle_share:.0%}" for r in ranks),
            f"{max(busy) / statistics.mean(busy):.2f}",
        ])
    return rows


def plot(results: dict[tuple[int, str], list[RankSteps]], path: Path, title: str) -> None:
    """Stacked bars per rank: busy seconds and waiting seconds of the median step."""
    plt = common.pyplot()
    worlds = sorted({world for world, _ in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 3.6), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        labels, busy, waiting = [], [], []
        for layout in LAYOUTS:
            for r in results[world, layout]:
                labels.append(f"{layout[:3]} r{r.rank}")
                busy.append(r.busy_median)
                waiting.append(statistics.median(w - b for b, w in zip(r.busy, r.wall)))
        ax.bar(labels, busy, color="C0", label="busy")
        ax.bar(labels, waiting, bottom=busy, color="C1", label="waiting for peers")
        ax.set_title(f"P = {world}")
        ax.set_ylabel("seconds per step")
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend(fontsize=8)
    common.save_figure(fig, path, title, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    common.check_outputs(args, "bench_load_balance", ["bench_load_balance.png"])
    run = common.Run(common.command_line("bench_load_balance", argv))
    results: dict[tuple[int, str], list[RankSteps]] = {}
    for world in args.worlds:
        for layout in LAYOUTS:
            results[world, layout] = run_workers(
                step_worker, world, args.model, args.seq_len, layout, args.steps, args.seed,
                timeout=args.timeout,
            )
            print(f"P={world} {layout}: done", flush=True)
    rows = run_rows(results)
    print(common.text_table(HEADER, rows))
    finished = run.finish()
    title = f"{args.model}, {args.seq_len} tokens, causal training step per rank"
    args.out.mkdir(parents=True, exist_ok=True)
    plot_path = args.out / "bench_load_balance.png"
    plot(results, plot_path, title)
    lines = [
        "### load-balance", "",
        *common.run_lines(finished, common.machine(threads=True), common.commit_version(ROOT)),
        f"- case: `{args.model}` (random weights), one sequence of {args.seq_len} random bytes, "
        f"{args.steps} timed steps after one warm-up, one thread per rank",
        "", common.markdown_table(HEADER, rows), "",
        f"![busy and waiting time per rank]({plot_path.name})",
    ]
    print("\n".join(lines))
    written = [plot_path]
    if args.json:
        args.json.write_text(json.dumps({"run": finished, "results": [
            {"world": world, "layout": layout, "ranks": [asdict(r) for r in ranks]}
            for (world, layout), ranks in results.items()]}, indent=1))
        written.append(args.json)
    if not args.no_doc:
        common.write_blocks(args.out / "benchmarks.md", SECTION, PREFIX,
                            {"load-balance": "\n".join(lines)})
        written.append(args.out / "benchmarks.md")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
