"""Passkey retrieval accuracy over a grid of context lengths x needle depths.

    python scripts/eval_passkey.py --models runs/tiny --lengths 1K 2K 4K 8K 16K \
        --depths 0 0.25 0.5 0.75 1 --num-examples 10 --out runs/eval/passkey

For every cell, ``--num-examples`` prompts of exactly that many bytes hide a ``--num-digits``
key at that depth (longnet.data.passkey_examples, seeded by ``--seed``); the prompt is read in
the model's own tokenizer (bytes, or the BPE its folder or checkpoint carries; the
``context_tokens`` column gives the lengths in tokens), the model greedily generates
``num_digits + 1`` tokens and an example is correct when their text starts with the key and no
further digit follows (longnet.data.passkey_match). Writes ``passkey.csv`` (one row per
model, length and depth), ``passkey_generations.csv`` (every example), ``passkey.png`` (a
depth-by-length heatmap per model, cells annotated with accuracy) and ``run.json``; for every
dilated model, ``passkey_visibility.csv``: accuracy per length and by whether the model's
heads see the copy the answer makes (``dense``: a rate-1 branch; ``sparse``: heads of sparse
branches only; ``unseen``: no head; longnet.eval.accuracy_by_visibility). A progress bar per
model and length counts the examples answered on stderr (``--no-progress`` hides it); as
each model x length finishes, a line gives its accuracy and the CSV files are written with
every row so far, so an interrupted run keeps them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from longnet.data.synthetic import min_passkey_length, needle_window
from longnet.eval import (
    PasskeyCell,
    accuracy_by_visibility,
    check_context_length,
    check_passkey_grid,
    evaluate_passkey,
    format_table,
    plot_passkey_heatmaps,
    write_csv,
)
from longnet.eval.cli import (
    ScriptParser,
    add_length_arguments,
    add_model_arguments,
    float_argument,
    lengths_from_args,
    models_from_args,
    positive_int_argument,
    run_cli,
)
from longnet.eval.reporting import write_run_info
from longnet.files import check_output_folder
from longnet.validation import UsageError

OUTPUTS = ["passkey.csv", "passkey_generations.csv", "passkey.png", "run.json",
           "passkey_visibility.csv"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, default_out="runs/eval/passkey")
    add_length_arguments(parser, "lengths", "max-length", "example lengths in bytes")
    parser.add_argument(
        "--depths", nargs="+", type=float_argument(0, 1), default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] (0 = start of the filler, 1 = just before the question)",
    )
    parser.add_argument("--num-examples", type=positive_int_argument, default=10,
                        help="examples per cell")
    parser.add_argument("--num-digits", type=positive_int_argument, default=5,
                        help="digits of the pass key (1-18)")
    args = parser.parse_args(argv)
    if args.num_digits > 18:
        parser.error(f"--num-digits: num_digits must be an integer in [1, 18] (the digits of the "
                     f"key), got {args.num_digits}")
    return args


def check_depths_apart(lengths: list[int], depths: list[float], num_digits: int) -> None:
    """Refuse a length whose filler is too short to place the needles of two of ``depths``
    apart (``longnet.data.synthetic.needle_window``): their cells would be one cell reported as
    two depths."""
    for length in lengths:
        budget = length - min_passkey_length(num_digits)
        seen: dict[tuple[int, int], float] = {}
        for depth in depths:
            window = needle_window(budget, depth)
            if window in seen:
                raise UsageError(
                    f"--lengths {length}: its filler of {budget} byte(s) puts the needle of depths "
                    f"{seen[window]:g} and {depth:g} on the same bytes ({window[0]} to "
                    f"{window[1]}); give longer lengths or fewer depths."
                )
            seen[window] = depth


def cell_rows(label: str, cells: list[PasskeyCell], num_digits: int
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``passkey.csv`` (one per cell) and ``passkey_generations.csv`` (one per
    example) of the model ``label``'s ``cells``."""
    rows, example_rows = [], []
    for cell in cells:
        rows.append({
            "model": label, "context_length": cell.length,
            "context_tokens": round(sum(o.prompt_tokens for o in cell.outcomes)
                                    / cell.num_examples) + num_digits,
            "depth": cell.depth, "mean_depth": cell.mean_depth, "examples": cell.num_examples,
            "correct": cell.num_correct, "accuracy": cell.accuracy,
        })
        example_rows += [
            {"model": label, "context_length": cell.length, "depth": cell.depth,
             "index": index, "actual_depth": o.depth,
             "needle_distance": o.needle_distance, "copy_distance": o.copy_distance,
             "visibility": o.visibility, "answer": o.answer,
             "generated": o.generated, "correct": o.correct,
             "prompt_tokens": o.prompt_tokens}
            for index, o in enumerate(cell.outcomes)
        ]
    return rows, example_rows


def write_tables(out: Path, tables: dict[str, list[dict[str, Any]]]) -> None:
    """Write each non-empty table (``{file name: rows}``) into ``out``, each whole."""
    for name, rows in tables.items():
        if rows:
            write_csv(rows, out / name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_folder(args.out, OUTPUTS)
    models = models_from_args(args)
    lengths = lengths_from_args(args, "lengths", "max-length", models)
    lengths, depths = check_passkey_grid(lengths, args.depths, args.num_digits)
    check_depths_apart(lengths, depths, args.num_digits)
    for item in models:  # refuse impossible lengths before any work
        for length in lengths:
            check_context_length(length, item.model)
    out = args.out
    rows, example_rows, visibility_rows, grids = [], [], [], {}
    for item in models:
        cells: list[PasskeyCell] = []
        dilated = any(rate > 1 for _, rate in item.model.config.pattern.branches)
        for length in lengths:  # the CSV files are written as each length finishes
            done = evaluate_passkey(
                item.model, [length], depths, num_examples=args.num_examples, seed=args.seed,
                num_digits=args.num_digits, batch_size=args.batch_size,
                progress=False if args.no_progress else f"passkey {item.label}",
                tokenizer=item.tokenizer,
            )
            cells += done
            new_rows, new_examples = cell_rows(item.label, done, args.num_digits)
            rows += new_rows
            example_rows += new_examples
            visibility = [{"model": item.label, **row}
                          for row in accuracy_by_visibility(cells)] if dilated else []
            write_tables(out, {"passkey.csv": rows, "passkey_generations.csv": example_rows,
                               "passkey_visibility.csv": visibility_rows + visibility})
            print(f"{item.label} @ {length}: accuracy "
                  f"{sum(c.num_correct for c in done)}/{sum(c.num_examples for c in done)}; "
                  f"{len(rows)} row(s) in {out / 'passkey.csv'}", flush=True)
        accuracy = np.full((len(depths), len(lengths)), np.nan)
        for cell in cells:
            accuracy[depths.index(cell.depth), lengths.index(cell.length)] = cell.accuracy
        grids[item.label] = (lengths, depths, accuracy)
        visibility_rows += visibility
    print(format_table(rows))
    if visibility_rows:
        print(format_table(visibility_rows))
    plot_passkey_heatmaps(
        grids, out / "passkey.png",
        title=f"Passkey retrieval accuracy ({args.num_examples} examples per cell, greedy)",
    )
    write_run_info(out / "run.json", {
        "models": {m.label: m.source for m in models}, "lengths": lengths,
        **{k: v for k, v in vars(args).items() if k not in ("models", "lengths")},
    })
    written = [out / "passkey.csv", out / "passkey_generations.csv", out / "passkey.png"]
    if visibility_rows:
        written.append(out / "passkey_visibility.csv")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
