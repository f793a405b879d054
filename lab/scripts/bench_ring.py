"""Sequence-parallel ring benchmark: per-rank peak memory, CPU time and bytes sent vs world size.

    python -m lab.scripts.bench_ring --seq-len 32768 --worlds 1 2 4 8 --transports ring allgather \
        --heads 8 --head-dim 64 --dtype float32 --base-segment 2048 --spawns 2 --timed-calls 2 \
        --dense-seq-len 8192 --update-docs

Systems and cases (every case runs forward + backward, causal by default):

* ``ours``: ``dilated_attention`` on the geometric pattern ``(base * 2**i, 2**i)`` for every
  ``base * 2**i <= N``, for each world size ``P`` and transport (``P = 1`` runs without a
  group: the single-device reference, one thread).
* dense comparison at ``--dense-seq-len``: ``ours`` with the single branch ``[(N, 1)]`` against
  ``ring-attention-pytorch``'s ``ring_flash_attn`` (``ring_reduce_col=True`` for ``P > 1``: its
  ring pass, the function its ``RingAttention`` module calls on CPU).
* a small gradient check (``--grad-seq-len``): out, dq, dk, dv of both systems on every world
  size against float64 SDPA (ours also in float64).

How each number is measured: ``lab/bench/ring.py``; the definitions of the columns and the
targets they are read against: ``docs/benchmarks.md``.

Outputs: tables on stdout, ``<out>/bench_ring.png`` (``bench_ring_<block>.png``), and in the
``## Sequence-parallel ring`` section of ``<out>/benchmarks.md`` the generated blocks ``<block>``
(default ``main``), ``dense`` and ``grads`` for the parts that ran, each replaced between its
markers (text outside the markers and other sections are kept); ``--json PATH`` every sample.
``--out`` defaults to ``runs/bench_ring``; ``--update-docs`` writes into the repository's
``docs/`` instead. Every output is checked before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from lab.bench import common, peers
from lab.bench.ring import (
    PREFIX,
    SECTION,
    Case,
    check_rows,
    geometric_branches,
    gradient_check,
    replay_kernels,
    run_cases,
)
from lab.bench.ring_report import (
    dense_rows,
    dense_table,
    generated_blocks,
    grad_table,
    main_rows,
    main_table,
    plot,
)
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.attention import padded_length
from longnet.cli.arguments import (
    float_argument,
    length_argument,
    non_negative_int_argument,
    position_argument,
    positive_int_argument,
)

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the commit the report names."""
TRANSPORTS = ("ring", "allgather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=length_argument, default=32768)
    parser.add_argument("--batch", type=positive_int_argument, default=1)
    parser.add_argument("--heads", type=positive_int_argument, default=8)
    parser.add_argument("--head-dim", type=positive_int_argument, default=64)
    parser.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32")
    parser.add_argument("--base-segment", type=length_argument, default=2048)
    parser.add_argument("--worlds", type=positive_int_argument, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--bidirectional", action="store_true", help="non-causal attention")
    parser.add_argument("--spawns", type=positive_int_argument, default=2,
                        help="fresh process groups per case")
    parser.add_argument("--timed-calls", type=positive_int_argument, default=2)
    parser.add_argument("--check-rows", type=positive_int_argument, default=32)
    parser.add_argument(
        "--replay-rounds", type=positive_int_argument, default=3,
        help="rounds of the kernel replay (median)",
    )
    parser.add_argument("--dense-seq-len", type=position_argument, default=8192,
                        help="0: skip the dense run")
    parser.add_argument("--dense-spawns", type=positive_int_argument, default=1)
    parser.add_argument("--bucket-size", type=positive_int_argument, default=1024)
    parser.add_argument("--grad-seq-len", type=position_argument, default=512, help="0: skip")
    parser.add_argument("--seed", type=non_negative_int_argument, default=0)
    parser.add_argument("--timeout", type=float_argument(0, exclusive=True), default=3600.0,
                        help="seconds per spawn")
    common.add_output_arguments(parser, "bench_ring")
    parser.add_argument("--block", type=common.name_argument, default="main",
                        help="name of the generated main block")
    args = parser.parse_args(argv)
    branches = geometric_branches(args.seq_len, args.base_segment)
    runs = [("--seq-len", args.seq_len, branches), ("--grad-seq-len", args.grad_seq_len, branches),
            ("--dense-seq-len", args.dense_seq_len, ((args.dense_seq_len, 1),))]
    for option, length, pattern in runs:
        for world in args.worlds:  # P = 1 runs without a group: any length
            padded = padded_length(length, pattern, world) if length and world > 1 else length
            if padded != length:
                parser.error(f"{option} {length} cannot be split over {world} ranks (--worlds) "
                             f"with the pattern {pattern}; use {padded}.")
    return args


def build_cases(args) -> tuple[list[Case], list[Case]]:
    """The dilated cases (P = 1 first, then every transport and P > 1) and the dense ones."""

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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    suffix = "" if args.block == "main" else f"_{args.block}"
    common.check_outputs(args, "bench_ring", [f"bench_ring{suffix}.png"])
    clock = common.Run(common.command_line(Path(__file__).stem, argv))
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
        sep="\n",
    )
    run = clock.finish(
        case=main_cases[0],
        plot=plot_path.name,
        machine=common.machine(python=True),
        ring_attention_version=peers.version("ring-attention-pytorch"),
    )
    print(f"plot: {plot_path}")
    if args.json:
        samples = [r.samples() for r in results + dense_results]
        args.json.write_text(
            json.dumps(
                dict(rows=rows, dense=dense, grads=grads, samples=samples), indent=1, default=str
            )
        )
        print(f"samples: {args.json}")
    if not args.no_doc:
        code = common.commit_version(ROOT)
        blocks = generated_blocks(args, run, code, rows, dense, grads)
        common.write_blocks(args.out / "benchmarks.md", SECTION, PREFIX, blocks)
        print(f"updated {args.out / 'benchmarks.md'} ({SECTION})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
