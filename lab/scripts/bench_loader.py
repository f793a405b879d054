"""Tokens per second of the training data loader alone (no model), at long windows.

    python -m lab.scripts.bench_loader --packages stdlib installed --seq-len 64K --batch-size 4 \
        --num-workers 0 2 --batches 100 --out runs/bench/loader.md

Builds (or loads from the cache) the ``LongDocumentDataModule`` of the repository-level corpus
``--packages`` (one document per package, ``longnet.data.repositories``) with packed documents,
then for each ``--num-workers`` takes one batch (worker start-up, not timed) and times the next
``--batches`` batches of its training loader, cycling through the windows as often as needed.
A GPU trained from this loader waits on it when its tokens per second are below the GPU's.

Outputs: the table on stdout; with ``--out PATH`` the same in markdown with the command,
machine and load average (nothing is written by default).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lab.bench import common
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import length_argument, positive_int_argument
from longnet.data import LongDocumentDataModule
from longnet.files import check_output_folder, write_atomic

ROOT = Path(__file__).resolve().parents[2]
HEADER = ["workers", "batch", "seq_len", "batches", "seconds", "M tokens/s"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", nargs="+", default=["stdlib"],
                        help="packages entries: stdlib, installed, <distribution>[==<version>]")
    parser.add_argument("--seq-len", type=length_argument, default=65536)
    parser.add_argument("--batch-size", type=positive_int_argument, default=4)
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2],
                        help="DataLoader worker processes, one measurement each")
    parser.add_argument("--batches", type=positive_int_argument, default=50,
                        help="timed batches per measurement")
    parser.add_argument("--threads", type=positive_int_argument,
                        help="torch threads of this process (default: torch's)")
    parser.add_argument("--cache-dir", help="corpus cache folder (default: the data module's)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if any(workers < 0 for workers in args.num_workers):
        parser.error(f"--num-workers must be 0 or more, got {args.num_workers}")
    return args


def cycle(loader: torch.utils.data.DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches, epoch after epoch."""
    return itertools.chain.from_iterable(itertools.repeat(loader))


def measure(module: LongDocumentDataModule, workers: int, batches: int) -> tuple[int, float]:
    """``(tokens, seconds)`` of ``batches`` training batches with ``workers`` workers, after
    one untimed batch."""
    module.num_workers = workers
    loader = cycle(module.train_dataloader())
    next(loader)
    tokens, start = 0, time.perf_counter()
    for batch in itertools.islice(loader, batches):
        tokens += batch["input_ids"].numel()
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out:
        check_output_folder(args.out.parent, [args.out.name], what="--out")
    argv = sys.argv[1:] if argv is None else argv
    run = common.Run(common.command_line("bench_loader", argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    module = LongDocumentDataModule(
        seq_len=args.seq_len, batch_size=args.batch_size, packages=args.packages,
        pack_documents=True, cache_dir=args.cache_dir,
    )
    module.setup()
    splits = module.splits
    corpus = (f"{len(module.source.packages)} packages, {len(module.source.files):,} files; "
              f"{len(splits.train):,} training windows; "
              f"{'built' if splits.built else 'loaded from the cache'} in "
              f"{time.perf_counter() - start:.1f} s ({splits.path})")
    print(corpus, flush=True)
    rows = []
    for workers in args.num_workers:
        tokens, seconds = measure(module, workers, args.batches)
        rows.append([str(workers), str(args.batch_size), str(args.seq_len), str(args.batches),
                     f"{seconds:.2f}", f"{tokens / seconds / 1e6:.2f}"])
        print(f"{workers} workers: {rows[-1][-1]} M tokens/s", flush=True)
    print(common.text_table(HEADER, rows))
    if args.out:
        lines = [
            "### data loader", "",
            *common.run_lines(run.finish(), common.machine(threads=True),
                              common.commit_version(ROOT)),
            f"- corpus: packages {' '.join(args.packages)}: {corpus}", "",
            common.markdown_table(HEADER, rows), "",
        ]
        write_atomic(args.out, "\n".join(lines))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
