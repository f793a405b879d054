"""Benchmark one training step of a LongNet LM against its dense twin: tokens/s vs length.

    python -m lab.scripts.bench_training --model longnet-tiny-16k --lengths 1K 2K 4K 8K 16K \
        --precision 32 --profile 16K --update-docs

A step is forward + loss + backward + AdamW on random bytes (``lab/bench/training.py``).
Per length the model runs with its own dilated pattern and as its dense twin (one branch
covering the sequence), interleaved, and the table reports median tokens/s, the dilated/dense
ratio, the same ratio of arithmetic (``forward_macs``: multiply-accumulates of the attention and
the linear layers, the most the pattern can save) and the dilated model's tokens/s relative to
its own at the shortest length (linear cost keeps it near 1). ``--profile LEN`` adds where one
dilated step's time goes at that length and the attention core's time per branch. Writes the
table and ``bench_training.png`` and the block ``<model>-<precision>`` of the "Training step"
section of ``<out>/benchmarks.md`` (``--out`` defaults to ``runs/bench_training``;
``--update-docs`` writes into the repository's ``docs/`` instead); ``--json PATH`` also writes
every sample. Every output is checked before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lab.bench import common
from lab.bench.training import (
    PRECISIONS,
    SYSTEMS,
    branch_seconds,
    forward_macs,
    profile_step,
    time_length,
    twin_config,
)
from lab.memory.state import model_config
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import (
    length_argument,
    non_negative_int_argument,
    path_argument,
    positive_int_argument,
)
from longnet.denormals import denormals_kept, flushing_denormals
from longnet.modeling import LongNetConfig

SECTION = "## Training step"
PREFIX = "bench_training"
INTRO = (
    "One training step (forward, loss, backward, AdamW) of a zoo model on random bytes, with "
    "its own dilated pattern and as its dense twin (one branch `(n, 1)`: dense causal "
    "attention), by `lab/scripts/bench_training.py`. Tokens/s are medians of interleaved steps."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=path_argument, required=True,
                        help="zoo name or model folder (its config)")
    parser.add_argument("--lengths", nargs="+", type=length_argument, required=True,
                        help="tokens per sample, e.g. 1K 4K 16K")
    parser.add_argument("--batch", type=positive_int_argument, default=1,
                        help="samples per step")
    parser.add_argument("--precision", choices=PRECISIONS, default="32",
                        help="32 (float32) or bf16 (bfloat16 autocast, as bf16-mixed)")
    parser.add_argument("--steps", type=positive_int_argument, default=3,
                        help="timed steps per system and length")
    parser.add_argument("--warmup", type=non_negative_int_argument, default=1,
                        help="untimed steps first")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--profile", type=length_argument, help="profile a dilated step at LEN")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run (cuda: device-synchronised step times)")
    common.add_output_arguments(parser, "bench_training")
    parser.add_argument("--tag", type=common.name_argument,
                        help="name of the doc block (default: model-precision)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is visible.")
    if args.device == "cuda" and args.profile is not None:
        parser.error("--profile splits CPU operator time; run it with --device cpu.")
    try:
        args.config = model_config(args.model)
    except ValueError as err:
        parser.error(f"--model: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tag = args.tag or f"{Path(str(args.model)).name}-{args.precision}"
    if args.device == "cuda":
        tag = f"gpu-{tag}"
    plot_name = f"bench_training_{tag}.png" if args.tag else "bench_training.png"
    common.check_outputs(args, "bench_training", [plot_name])
    run = common.Run(common.command_line("bench_training", sys.argv[1:] if argv is None
                                         else argv, ["OMP_NUM_THREADS"]))
    config = args.config
    timings = []
    for length in sorted(args.lengths):
        found = time_length(config, length, batch=args.batch, precision=args.precision,
                            steps=args.steps, warmup=args.warmup, systems=args.systems,
                            device=args.device)
        timings += found
        print(" ".join(f"{t.system} @ {length}: {t.tokens_per_s:,.0f} tokens/s" for t in found),
              flush=True)
    by = {(t.system, t.length): t for t in timings}
    shortest = min(args.lengths)
    header = ["length", *(f"{s} tokens/s" for s in args.systems)]
    if len(args.systems) == 2:
        header += ["dilated / dense", "arithmetic dense / dilated"]
    if "dilated" in args.systems:
        header.append(f"dilated vs its own at {shortest}")
    rows = []
    for length in sorted(args.lengths):
        row = [str(length)] + [f"{by[s, length].tokens_per_s:,.0f}" for s in args.systems]
        if len(args.systems) == 2:
            row.append(common.ratio(by["dilated", length].tokens_per_s,
                                    by["dense", length].tokens_per_s))
            row.append(common.ratio(_macs(twin_config(config, "dense", length), length),
                                    _macs(config, length)))
        if "dilated" in args.systems:
            row.append(common.ratio(by["dilated", length].tokens_per_s,
                                    by["dilated", shortest].tokens_per_s))
        rows.append(row)
    lines = [common.markdown_table(header, rows)]
    profile, branches = [], []
    if args.profile is not None:
        profile = profile_step(config, args.profile, batch=args.batch, precision=args.precision)
        total = sum(seconds for _, seconds in profile)
        lines += ["", f"Where one dilated step's time goes at {args.profile} tokens "
                  f"(profiler, {total:.2f} s of operator time):", "",
                  common.markdown_table(["part", "s", "share"], [
                      [name, f"{seconds:.3f}", f"{seconds / total:.0%}"]
                      for name, seconds in profile])]
        branches = branch_seconds(config, args.profile, batch=args.batch,
                                  precision=args.precision)
        lines += ["", f"Attention core alone, forward + backward per branch at {args.profile} "
                  f"tokens, all {config.num_layers} layers:", "",
                  common.markdown_table(["branch (w, r)", "s"], [
                      [f"({w}, {r})", f"{seconds:.3f}"] for (w, r), seconds in branches])]
    finished = run.finish()
    threads = torch.get_num_threads()
    machine = common.machine(threads=True)
    if args.device == "cuda":
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host {machine}"
    head = common.run_lines(finished, machine,
                            common.commit_version(Path(__file__).resolve().parents[2]))
    block = "\n".join([f"### {tag}", "", *head,
                       f"- model: `{args.model}`, batch {args.batch}, precision {args.precision}, "
                       f"{args.steps} timed steps per point after {args.warmup} warm-up, "
                       f"{threads} threads", "", *lines])
    print(block)
    args.out.mkdir(parents=True, exist_ok=True)
    written = [_plot(timings, args, args.out / plot_name)]
    if args.json is not None:
        args.json.write_text(json.dumps({
            "run": finished, "timings": [t.__dict__ for t in timings],
            "profile": profile, "branches": branches,
        }, indent=2) + "\n")
        written.append(args.json)
    if not args.no_doc:
        common.write_blocks(args.out / "benchmarks.md", SECTION, PREFIX, {tag: block}, INTRO)
        written.append(args.out / "benchmarks.md")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _macs(config: LongNetConfig, length: int) -> int:
    return sum(forward_macs(config, length).values())


def _plot(timings, args: argparse.Namespace, path: Path) -> Path:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for system in args.systems:
        points = sorted((t.length, t.tokens_per_s) for t in timings if t.system == system)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
    common.log2_axis(ax, "tokens per sample", "training tokens/s", ticks=sorted(args.lengths),
                     log_y=True)
    common.save_figure(fig, path, f"Training step of {args.model} ({args.precision})", dpi=120)
    return path


if __name__ == "__main__":
    with flushing_denormals(not denormals_kept()):  # as `longnet fit` (before any torch work)
        sys.exit(run_cli(main))
