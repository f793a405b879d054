"""Benchmark exact dilated attention against dense SDPA: time, peak memory and error vs length.

    python -m lab.scripts.bench_attention --lengths 2048 4096 8192 --pattern 2048,4096,8192/1,2,4 \
        --causal [--heads 8 --head-dim 64 --batch 1 --dtype float32 --repeats 5 --update-docs]

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
fresh child process per (system, length, mode) (see ``MEMORY_DEFINITION`` in
``lab/bench/attention.py``; the targets: ``docs/benchmarks.md``).

Pattern: ``geometric`` (LongNet: ``w = 2048 * 2**i, r = 2**i`` for every ``w <= n``),
``dense``, or explicit ``2048,4096,8192/1,2,4`` or ``2048:1,4096:2,8192:4``.

Every length is timed in its own child process and every memory point is measured in another
one, so an out-of-memory kill is recorded as a failed point, not a lost run.

``--device cuda`` runs the GPU benchmark instead (``lab/bench/device.py``): one process,
CUDA-event medians, the allocator's peak memory, dense SDPA per backend as rows; its block
goes to the "GPU" section of ``<out>/benchmarks.md``::

    python -m lab.scripts.bench_attention --device cuda --dtype bfloat16 --heads 16 --causal \
        --pattern geometric --lengths 8192 32768 131072 524288 1048576

Outputs: a table on stdout (a progress line per point), ``<out>/bench_attention_<tag>.png``
and the block ``<tag>`` of the attention section of ``<out>/benchmarks.md`` (replaced if it
exists). ``--out`` defaults to ``runs/bench_attention``; ``--update-docs`` writes into the
repository's ``docs/`` instead (``docs/benchmarks.md``). ``--json PATH`` also writes every
sample. Every output is checked before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from lab.bench import common, device
from lab.bench.attention import (
    ENV_VARS,
    HEADER,
    MEMORY_DEFINITION,
    PREFIX,
    SECTION,
    SYSTEMS,
    Shape,
    consistency_notes,
    describe_pattern,
    markdown_block,
    measure_length,
    memory_child,
    notes,
    pattern_argument,
    pattern_tag,
    plot,
    resolve_pattern,
    sdpa_backend,
    table_rows,
    timing_child,
)
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import (
    float_argument,
    length_argument,
    non_negative_int_argument,
    position_argument,
    positive_int_argument,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=length_argument, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--pattern", default="2048,4096,8192/1,2,4", type=pattern_argument)
    parser.add_argument("--heads", type=positive_int_argument, default=8)
    parser.add_argument("--head-dim", type=positive_int_argument, default=64)
    parser.add_argument("--batch", type=positive_int_argument, default=1)
    parser.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=positive_int_argument, default=5,
                        help="timed runs per point (max)")
    parser.add_argument("--point-budget", type=float_argument(0, exclusive=True), default=120.0,
                        help="fewer repeats when the warm-up says a length would take longer "
                             "than this many seconds (at least 1 run)")  # fmt: skip
    parser.add_argument(
        "--threads", type=positive_int_argument, default=None,
        help="torch threads (default: torch's)",
    )
    parser.add_argument("--warmup-max-len", type=position_argument, default=262144,
                        help="above this length: no warm-up call and one timed run")  # fmt: skip
    parser.add_argument("--sdpa-max-len", type=position_argument, default=32768,
                        help="dense systems run up to this length only")  # fmt: skip
    parser.add_argument("--systems", nargs="+", choices=sorted({*SYSTEMS, *device.SYSTEMS}),
                        help=f"default: {' '.join(SYSTEMS)} on the CPU, "
                             f"{' '.join(device.SYSTEMS)} with --device cuda")  # fmt: skip
    parser.add_argument("--check-rows", type=positive_int_argument, default=32)
    parser.add_argument("--seed", type=non_negative_int_argument, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU benchmark (one process, CUDA events)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    common.add_output_arguments(parser, "bench_attention")
    parser.add_argument("--tag", type=common.name_argument, default=None,
                        help="name of the plot and the doc block")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timing-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shape = Shape(args.batch, args.heads, args.head_dim, args.dtype)
    known = device.SYSTEMS if args.device == "cuda" else SYSTEMS
    args.systems = args.systems or list(known)
    if unknown := [s for s in args.systems if s not in known]:
        parser.error(f"--systems {' '.join(unknown)}: not run with --device {args.device} "
                     f"(choose from {' '.join(known)})")
    if args.tag is None:
        direction = "causal" if args.causal else "bidirectional"
        args.tag = f"{direction}-{pattern_tag(args.pattern)}-{args.dtype}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        print("RESULT " + json.dumps(memory_child(json.loads(args.memory_child))), flush=True)
        return 0
    if args.timing_child is not None:
        print("RESULT " + json.dumps(timing_child(args.timing_child, args)), flush=True)
        return 0
    argv = sys.argv[1:] if argv is None else argv
    if args.device == "cuda":
        return run_on_gpu(args, argv)
    plot_name = f"bench_attention_{args.tag}.png"
    common.check_outputs(args, "bench_attention", [plot_name])
    clock = common.Run(common.command_line("bench_attention", argv, ENV_VARS))
    digest = common.attention_digest()
    version = common.source_version(digest, ROOT)  # before the run: HEAD may move while it runs
    print(version)
    print(f"{args.tag}: {describe_pattern(args.pattern)}, causal={args.causal}, {args.shape}")
    points = [point for n in args.lengths for point in measure_length(SCRIPT, n, args, argv)]
    changed = consistency_notes(points, digest)
    print("\n" + common.text_table(HEADER, table_rows(points)))
    for line in notes(points):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_path = args.out / plot_name
    title = f"{args.tag}: {describe_pattern(args.pattern)}, {args.shape}"
    plot(points, plot_path, title)
    run = clock.finish(
        machine=common.machine(threads=True, ram=True),
        version=version,
        sdpa_backend=sdpa_backend(args.causal),
        plot=plot_path.name,
        warnings=changed,
    )
    print(f"plot: {plot_path}; wall time {run['wall_s']:.0f} s")
    write_samples(args, run, points)
    if not args.no_doc:
        block = {args.tag: markdown_block(points, args, run)}
        common.write_blocks(args.out / "benchmarks.md", SECTION, PREFIX, block, MEMORY_DEFINITION)
        print(f"updated {args.out / 'benchmarks.md'} block {args.tag}")
    return 0


def run_on_gpu(args: argparse.Namespace, argv: list[str]) -> int:
    """``--device cuda``: every length in this process (``lab/bench/device.py``)."""
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py: --device cuda needs a CUDA device; none is visible.")
    tag = f"gpu-{args.tag}"
    plot_name = f"bench_attention_{tag}.png"
    common.check_outputs(args, "bench_attention", [plot_name])
    gpu = torch.device("cuda")
    clock = common.Run(common.command_line("bench_attention", argv, ENV_VARS))
    version = common.source_version(common.attention_digest(), ROOT)
    points = []
    for n in args.lengths:
        names = [s for s in args.systems if s == "ours" or n <= args.sdpa_max_len]
        found = device.measure_length(
            n, resolve_pattern(args.pattern, n), names, batch=args.batch, heads=args.heads,
            head_dim=args.head_dim, dtype=common.DTYPES[args.dtype], device=gpu,
            causal=args.causal, repeats=args.repeats, check_rows=args.check_rows, seed=args.seed,
        )
        points += found
        print(common.text_table(device.HEADER, device.table_rows(found)), flush=True)
    name = torch.cuda.get_device_name(gpu)
    title = f"{tag}: {describe_pattern(args.pattern)}, {args.shape}, {name}"
    args.out.mkdir(parents=True, exist_ok=True)
    plot_path = args.out / plot_name
    device.plot(points, plot_path, title)
    run = clock.finish()
    lines = [
        f"### {tag}", "",
        f"- pattern: {describe_pattern(args.pattern)}; causal={args.causal}; {args.shape}",
        f"- command: `{run['command']}`",
        f"- machine: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}; {version}",
        f"- date: {run['date']}; wall time of the run {run['wall_s']:.0f} s",
        f"- method: {device.METHOD}",
        "", common.markdown_table(device.HEADER, device.table_rows(points)), "",
        f"![time vs length]({plot_path.name})",
    ]
    print("\n".join(lines))
    print(f"plot: {plot_path}")
    write_samples(args, run, points)
    if not args.no_doc:
        common.write_blocks(args.out / "benchmarks.md", "## GPU", PREFIX, {tag: "\n".join(lines)})
        print(f"updated {args.out / 'benchmarks.md'} block {tag}")
    return 0


def write_samples(args: argparse.Namespace, run: dict, points: list) -> None:
    """``--json``: the run's description and every point with its samples."""
    if args.json:
        samples = [asdict(p) for p in points]
        args.json.write_text(json.dumps({"run": run, "points": samples}, indent=1))
        print(f"samples: {args.json}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
