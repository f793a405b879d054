"""LongNet models through EleutherAI's lm-eval, offline: bits per byte and RULER's NIAH.

    python scripts/eval_harness.py --models longnet-tiny --tasks bpb niah_single_1 \
        --niah-lengths 1K --niah-examples 20 --compare --out runs/eval/harness

Registers the LongNet classes with transformers (``longnet.hf``) and runs lm-eval's
``simple_evaluate`` with an ``HFLM`` over each model (zoo names, ``save_pretrained`` folders,
Lightning ``.ckpt`` files) and the byte tokenizer. Tasks: ``bpb`` (a local
``loglikelihood_rolling`` task over the held-out documents that ``eval_perplexity.py``
scores, windows of ``--context-length``; ``--compare`` adds ``eval_perplexity.py``'s value
for the same windows) and RULER's ``niah_single_1`` / ``niah_multikey_2`` (generated
haystacks, at each ``--niah-lengths``). Writes ``harness.csv`` (one row per value; written
again as each model finishes, with every row so far, so an interrupted run keeps them; lm-eval
shows its own progress bars) and ``run.json``; the tasks and tokenizer lm-eval reads are
written to a temporary folder.
Needs ``pip install -e ".[eval-harness]"``; nothing is downloaded (``HF_HUB_OFFLINE`` and
``HF_DATASETS_OFFLINE`` are set). See docs/evaluation.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / transformers are imported
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from longnet.eval import format_table, write_csv  # noqa: E402
from longnet.eval.cli import (  # noqa: E402
    ScriptParser,
    add_document_arguments,
    add_model_arguments,
    documents_from_args,
    length_argument,
    models_from_args,
    positive_int_argument,
    run_cli,
)
from longnet.eval.reporting import write_run_info  # noqa: E402
from longnet.files import check_output_folder  # noqa: E402

try:
    from longnet.hf.harness import BPB_TASK, NIAH_TASKS, evaluate_model  # noqa: E402
except ModuleNotFoundError as err:  # lm-eval (or one of its own dependencies) is not installed
    sys.exit(f"error: eval_harness.py needs EleutherAI's lm-eval, and importing it failed "
             f"({err}); install it with pip install -e \".[eval-harness]\".")

TASKS = ("bpb", *NIAH_TASKS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, default_out="runs/eval/harness")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument(
        "--context-length", type=length_argument,
        help="lm-eval's max_length for the bpb task (default: each model's max_positions)",
    )
    parser.add_argument(
        "--niah-lengths", nargs="+", type=length_argument, metavar="LEN",
        help="NIAH example lengths in bytes, generated answer included (default: the context)",
    )
    parser.add_argument("--niah-examples", type=positive_int_argument, default=20,
                        help="NIAH examples per task and length (RULER generates 500)")
    parser.add_argument("--compare", action="store_true",
                        help="also score the bpb documents as eval_perplexity.py does")
    add_document_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_folder(args.out, ["harness.csv", "run.json"])
    models = models_from_args(args)
    documents = documents_from_args(args) if "bpb" in args.tasks else None
    niah = [task for task in args.tasks if task in NIAH_TASKS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="longnet-harness-") as work:  # tasks, tokenizer
        for index, loaded in enumerate(models):
            rows += evaluate_model(
                loaded, Path(work) / str(index), documents=documents, niah_tasks=niah,
                context_length=args.context_length, niah_lengths=args.niah_lengths or (),
                niah_examples=args.niah_examples, batch_size=args.batch_size,
                compare=args.compare, seed=args.seed,
            )
            write_csv(rows, args.out / "harness.csv")
            print(f"{loaded.label}: done; {len(rows)} row(s) in {args.out / 'harness.csv'}",
                  flush=True)
    print(format_table(rows))
    write_run_info(args.out / "run.json", {
        "models": {m.label: m.source for m in models},
        **{k: v for k, v in vars(args).items() if k != "models"},
        "documents": None if documents is None else [d.doc_id for d in documents],
    })
    for loaded in models if args.compare and documents is not None else ():
        value = {r["task"]: r["value"] for r in rows if r["model"] == loaded.label
                 and r["metric"] in ("bits_per_byte", "scored_bits_per_byte")}
        print(f"{loaded.label}: lm-eval {value[BPB_TASK]:.6f}, eval_perplexity.py "
              f"{value['eval_perplexity']:.6f} bits per byte (difference "
              f"{value[BPB_TASK] - value['eval_perplexity']:+.2e})")
    print(f"wrote {args.out / 'harness.csv'}, {args.out / 'run.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
