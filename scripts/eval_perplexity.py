"""Bits per byte (and perplexity) versus context length on held-out long documents.

    python scripts/eval_perplexity.py --models longnet-tiny runs/tiny last.ckpt \
        --context-lengths 1K 2K 4K 8K 16K --stride 0.5 --out runs/eval/perplexity

Every token of every document (and each closing EOS) is scored exactly once with sliding
windows that stay inside their document (longnet.eval.sliding), in each model's own tokenizer
(bytes, or the BPE its folder or checkpoint carries); bits per byte divide by the documents'
UTF-8 bytes, so every model is compared on the same bytes. Context lengths are in tokens
(the ``context_bytes`` column gives them in bytes). Writes ``perplexity.csv``
(one row per model and context length), ``compressors.csv`` (gzip/bzip2/xz bits per byte of
the same documents, each document compressed separately and all concatenated),
``perplexity.png`` (one line per model, compressors as horizontal lines) and ``run.json``.
A progress bar per model and context length is shown on stderr (``--no-progress`` hides it);
as each model x context length finishes, a line gives its bits per byte and ``perplexity.csv``
(and ``positions.csv``) is written with every row so far, so an interrupted run keeps them.

``--score-from N`` adds the bits per byte of the bytes at document positions ``>= N`` only: the
same bytes under every context length (use N >= the longest context, with documents longer than
N), and plots that instead. ``--by-position`` adds ``positions.csv`` and ``positions.png``: bits
per byte of the bytes at positions 0-512, 512-1K, 1K-2K, ... of their document, per model and
context length. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from longnet.data.compressors import MODES
from longnet.eval import (
    ContextScore,
    bits_per_byte_rows,
    compressor_baselines,
    format_table,
    plot_bits_by_position,
    plot_bits_per_byte,
    position_buckets,
    position_rows,
    score_models,
    write_csv,
)
from longnet.eval.cli import (
    ScriptParser,
    add_document_arguments,
    add_length_arguments,
    add_model_arguments,
    documents_from_args,
    lengths_from_args,
    models_from_args,
    position_argument,
    run_cli,
    stride_argument,
)
from longnet.eval.reporting import write_run_info
from longnet.files import check_output_folder
from longnet.validation import UsageError

OUTPUTS = ["perplexity.csv", "compressors.csv", "perplexity.png", "run.json"]
BY_POSITION_OUTPUTS = ["positions.csv", "positions.png"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, default_out="runs/eval/perplexity")
    add_length_arguments(parser, "context-lengths", "max-context", "window lengths in tokens")
    parser.add_argument(
        "--stride", type=stride_argument, default=0.5,
        help="window step: tokens (512, 1K) or a fraction of the context (default 0.5); "
        "scored tokens outside a document's first window see >= context - stride tokens",
    )
    add_document_arguments(parser)
    parser.add_argument(
        "--score-from", type=position_argument,
        help="also score only the bytes at document positions >= this (the same bytes for "
        "every context length; 0: every byte, the closing EOS left out); the plot shows these",
    )
    parser.add_argument(
        "--by-position", action="store_true",
        help="write positions.csv/png: bits per byte by position bucket within the document",
    )
    parser.add_argument(
        "--compress-mode", choices=MODES, default="separate",
        help="which compressor baseline the plot shows (the CSV has both)",
    )
    return parser.parse_args(argv)


def result_rows(
    scores: list[ContextScore], score_from: int | None, buckets: list[tuple[int, int]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``perplexity.csv`` and (with ``buckets``) of ``positions.csv``."""
    rows = bits_per_byte_rows(scores, score_from)
    return rows, position_rows(scores, buckets) if buckets else []


def write_result_rows(out: Path, rows: list[dict[str, Any]],
                      by_position: list[dict[str, Any]]) -> None:
    """Write ``perplexity.csv`` and (when there are such rows) ``positions.csv``, each whole."""
    write_csv(rows, out / "perplexity.csv")
    if by_position:
        write_csv(by_position, out / "positions.csv")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_folder(args.out, OUTPUTS + (BY_POSITION_OUTPUTS if args.by_position else []))
    models = models_from_args(args)
    lengths = lengths_from_args(args, "context-lengths", "max-context", models)
    documents = documents_from_args(args)
    longest = max(doc.num_bytes for doc in documents) + 1
    print(f"{len(documents)} documents, {sum(d.num_bytes for d in documents):,} bytes, longest "
          f"{longest - 1:,}; context lengths {lengths}")
    if max(lengths) > longest:
        print(f"note: context lengths above {longest} (the longest document + 1) see no more "
              "context than that; see the longest_window column.")
    if args.score_from is not None and args.score_from >= longest - 1:
        raise UsageError(
            f"--score-from {args.score_from} leaves no byte to score: the longest document has "
            f"{longest - 1} bytes; lower it or raise --min-document-bytes above it."
        )
    buckets = position_buckets(longest - 1) if args.by_position else None
    finished: list[ContextScore] = []

    def keep(score: ContextScore) -> None:
        """Write every row so far and say which model x length finished."""
        finished.append(score)
        write_result_rows(args.out, *result_rows(finished, args.score_from, buckets))
        print(f"{score.model.label} @ {score.result.context_length}: "
              f"{score.result.bits_per_byte:.4f} bits per byte ({score.seconds} s); "
              f"{len(finished)} row(s) in {args.out / 'perplexity.csv'}", flush=True)

    scores = score_models(
        models, documents, lengths, stride=args.stride, batch_size=args.batch_size,
        progress=not args.no_progress, on_score=keep,
    )
    rows, by_position = result_rows(scores, args.score_from, buckets)
    baselines = compressor_baselines([doc.utf8 for doc in documents])
    base_rows = [
        {"compressor": b.compressor, "mode": b.mode, "raw_bytes": b.raw_bytes,
         "compressed_bytes": b.compressed_bytes, "bits_per_byte": b.bits_per_byte}
        for b in baselines
    ]
    columns = ["model", "context_length", "context_bytes", "stride", "windows",
               "longest_window", "bits_per_byte", "perplexity", "seconds"]
    if args.score_from is not None:
        columns[-1:-1] = ["scored_bytes", "scored_bits_per_byte"]
    if by_position:
        print(format_table(by_position))
    print(format_table(rows, columns))
    print(format_table(base_rows))
    out = args.out
    write_csv(base_rows, out / "compressors.csv")
    value = "bits_per_byte" if args.score_from is None else "scored_bits_per_byte"
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        curves.setdefault(row["model"], []).append((row["context_length"], row[value]))
    scored = "" if args.score_from is None else f", bytes at positions >= {args.score_from}"
    plot_bits_per_byte(
        curves,
        {b.compressor: b.bits_per_byte for b in baselines if b.mode == args.compress_mode},
        out / "perplexity.png",
        title=f"Bits per byte vs context ({len(documents)} {args.split} documents, "
        f"stride {args.stride}{scored})",
        baseline_note=f" ({args.compress_mode})" if args.compress_mode != "separate" else "",
        training_lengths={m.label: m.training_length for m in models},
    )
    write_run_info(out / "run.json", {
        "models": {m.label: m.source for m in models},
        "context_lengths": lengths,
        **{k: v for k, v in vars(args).items() if k not in ("models", "context_lengths")},
        "documents": [d.doc_id for d in documents],
    })
    written = [out / "perplexity.csv", out / "compressors.csv", out / "perplexity.png"]
    if by_position:
        written += [out / "positions.csv", plot_bits_by_position(
            {f"{s.model.label} @ {s.result.context_length}": [
                (r["start"], r["end"], r["bits_per_byte"]) for r in by_position
                if r["model"] == s.model.label and r["context_length"] == s.result.context_length
            ] for s in scores},
            out / "positions.png",
            title=f"Bits per byte by position ({len(documents)} {args.split} documents)",
        )]
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
