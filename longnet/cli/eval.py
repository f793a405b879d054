"""``longnet eval perplexity|passkey|harness``: options, tables, plots and ``run.json`` in
``--out`` for :mod:`longnet.eval` (and :mod:`longnet.hf.harness`). The CSV files are rewritten
as each model x length finishes, so an interrupted run keeps its rows (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longnet.cli.arguments import (
    argument_type,
    device_argument,
    float_argument,
    int_between,
    json_object_argument,
    length_argument,
    non_negative_int_argument,
    path_argument,
    position_argument,
    positive_int_argument,
    stride_argument,
)
from longnet.data.compressors import MODES
from longnet.data.synthetic import min_passkey_length, needle_window
from longnet.eval import (
    ContextScore,
    LoadedModel,
    PasskeyCell,
    accuracy_by_visibility,
    bits_per_byte_rows,
    check_context_length,
    check_passkey_grid,
    compressor_baselines,
    default_context_lengths,
    evaluate_passkey,
    format_table,
    load_eval_documents,
    load_models,
    plot_bits_by_position,
    plot_bits_per_byte,
    plot_passkey_heatmaps,
    position_buckets,
    position_rows,
    score_models,
    write_csv,
)
from longnet.eval.documents import EVAL_SPLITS, EvalDocument
from longnet.eval.passkey import passkey_rows
from longnet.eval.perplexity import MIN_CONTEXT
from longnet.eval.reporting import write_run_info
from longnet.files import check_output_folder
from longnet.validation import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
HARNESS_TASKS = ("bpb", "niah_single_1", "niah_multikey_2")
"""``bpb`` and ``longnet.hf.harness.NIAH_TASKS`` (not imported here: that needs lm-eval)."""


def add_model_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    """``--models``, ``--labels``, ``--overrides``, ``--device``, ``--dtype``,
    ``--batch-size``, ``--seed``, ``--out``, ``--no-progress``."""
    add = parser.add_argument
    add("--models", nargs="+", required=True, metavar="MODEL",
        help="zoo names, save_pretrained folders or Lightning .ckpt files")
    add("--labels", nargs="+", help="names in tables/plots, one per model")
    add("--overrides", nargs="+", type=json_object_argument, metavar="JSON",
        help="config overrides applied at load, one JSON object for all models or one per "
        "model, e.g. '{}' '{\"attention_sinks\": 4, \"select_top_k\": 16}' (folders and zoo "
        "names only)")
    add("--device", type=device_argument, default="cpu",
        help="cpu, cuda, cuda:1 or mps (default: cpu)")
    add("--dtype", choices=sorted(DTYPES), default="float32")
    add("--batch-size", type=positive_int_argument, default=1, help="sequences per forward pass")
    add("--seed", type=non_negative_int_argument, default=0,
        help="seed of torch and of the examples")
    add("--out", type=path_argument, default=Path(default_out), help="output folder")
    add("--no-progress", action="store_true", help="hide the progress bars")


def models_from_args(args: argparse.Namespace) -> list[LoadedModel]:
    """Seed torch and load ``--models`` on ``--device`` in ``--dtype``."""
    torch.manual_seed(args.seed)
    return load_models(args.models, device=torch.device(args.device), dtype=DTYPES[args.dtype],
                       labels=args.labels, overrides=args.overrides)


def add_length_arguments(
    parser: argparse.ArgumentParser, option: str, cap: str, what: str
) -> None:
    """``--<option>``: lengths like ``1K 4K 16K`` (``what``: for the help), and ``--<cap>``."""
    parser.add_argument(
        f"--{option}", nargs="+", type=length_argument, metavar="LEN",
        help=f"{what}, e.g. 1K 4K 16K (default: powers of two from 1K to 16x the longest "
        f"training length, capped by --{cap})")
    parser.add_argument(f"--{cap}", type=length_argument, help="cap of the default lengths")


def lengths_from_args(
    args: argparse.Namespace, option: str, cap: str, models: list[LoadedModel]
) -> list[int]:
    """``--<option>``, else :func:`longnet.eval.default_context_lengths` up to ``--<cap>``.

    Raises:
        UsageError: ``--<cap>`` leaves no default length.
    """
    given, limit = getattr(args, option.replace("-", "_")), getattr(args, cap.replace("-", "_"))
    lengths = given or [n for n in default_context_lengths(models) if limit is None or n <= limit]
    if not lengths:
        raise UsageError(
            f"--{cap} {limit} leaves no default length (the shortest is {MIN_CONTEXT}); raise "
            f"it or give the lengths with --{option}.")
    return lengths


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    """The options choosing the held-out documents (:func:`documents_from_args`)."""
    add, fraction = parser.add_argument, float_argument(0, 1, exclusive=True)
    add("--data-files", nargs="+", help="text/json/parquet globs (default: stdlib)")
    add("--corpus", nargs="+", metavar="ENTRY",
        help="offline corpus instead of --data-files: stdlib and/or installed distributions, "
        "e.g. --corpus stdlib sympy==1.14.0 (default: stdlib)")
    add("--text-column", default="text", help="text column of json/parquet rows")
    add("--split", default="test", choices=list(EVAL_SPLITS),
        help="held-out = validation + test (default: test)")
    add("--val-fraction", type=fraction, default=0.05)
    add("--test-fraction", type=fraction, default=0.05)
    add("--max-documents", type=positive_int_argument, help="read only the first N documents")
    add("--min-document-bytes", type=non_negative_int_argument, default=0,
        help="evaluate only documents at least this long (e.g. the longest context)")


def documents_from_args(args: argparse.Namespace) -> list[EvalDocument]:
    """The documents :func:`add_document_arguments` selects."""
    return load_eval_documents(
        args.data_files, corpus=args.corpus, split=args.split, val_fraction=args.val_fraction,
        test_fraction=args.test_fraction, text_column=args.text_column,
        max_documents=args.max_documents, min_bytes=args.min_document_bytes)


def write_settings(args: argparse.Namespace, models: list[LoadedModel], **settings: Any) -> None:
    """``run.json`` in ``--out``: the models' sources, ``settings``, then the other options."""
    write_run_info(args.out / "run.json", {
        "models": {m.label: m.source for m in models}, **settings,
        **{k: v for k, v in vars(args).items() if k not in ("models", "run", *settings)}})


def perplexity_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_out="runs/eval/perplexity")
    add_length_arguments(parser, "context-lengths", "max-context", "window lengths in tokens")
    parser.add_argument(
        "--stride", type=stride_argument, default=0.5,
        help="window step: tokens (512, 1K) or a fraction of the context (default 0.5); scored "
        "tokens outside a document's first window see >= context - stride tokens")
    add_document_arguments(parser)
    parser.add_argument(
        "--score-from", type=position_argument,
        help="also score only the bytes at document positions >= this (the same bytes for "
        "every context length; 0: every byte, the closing EOS left out); the plot shows these")
    parser.add_argument(
        "--by-position", action="store_true",
        help="write positions.csv/png: bits per byte by position bucket within the document")
    parser.add_argument("--compress-mode", choices=MODES, default="separate",
                        help="which compressor baseline the plot shows (the CSV has both)")


def perplexity(args: argparse.Namespace) -> int:
    """Bits per byte (and perplexity) versus context length on held-out long documents.

    Every token is scored once, with sliding windows inside its document, in each model's
    tokenizer; bits per byte divide by the same UTF-8 bytes for every model. Writes
    perplexity.csv, compressors.csv (gzip/bzip2/xz), perplexity.png and run.json;
    --by-position adds positions.csv/png.
    """
    by_position_files = ["positions.csv", "positions.png"] if args.by_position else []
    check_output_folder(args.out, ["perplexity.csv", "compressors.csv", "perplexity.png",
                                   "run.json", *by_position_files])
    models = models_from_args(args)
    lengths = lengths_from_args(args, "context-lengths", "max-context", models)
    documents, out = documents_from_args(args), args.out
    longest = max(doc.num_bytes for doc in documents) + 1
    print(f"{len(documents)} documents, {sum(d.num_bytes for d in documents):,} bytes, longest "
          f"{longest - 1:,}; context lengths {lengths}")
    if max(lengths) > longest:
        print(f"note: context lengths above {longest} (the longest document + 1) see no more "
              "context than that; see the longest_window column.")
    if args.score_from is not None and args.score_from >= longest - 1:
        raise UsageError(
            f"--score-from {args.score_from} leaves no byte to score: the longest document has "
            f"{longest - 1} bytes; lower it or raise --min-document-bytes above it.")
    buckets = position_buckets(longest - 1) if args.by_position else None
    finished: list[ContextScore] = []

    def tables(scores: list[ContextScore]) -> dict[str, list[dict[str, Any]]]:
        return {"perplexity.csv": bits_per_byte_rows(scores, args.score_from),
                "positions.csv": position_rows(scores, buckets) if buckets else []}

    def keep(score: ContextScore) -> None:
        """Write every row so far and say which model x length finished."""
        finished.append(score)
        write_tables(out, tables(finished))
        print(f"{score.model.label} @ {score.result.context_length}: "
              f"{score.result.bits_per_byte:.4f} bits per byte ({score.seconds} s); "
              f"{len(finished)} row(s) in {out / 'perplexity.csv'}", flush=True)

    scores = score_models(models, documents, lengths, stride=args.stride,
                          batch_size=args.batch_size, progress=not args.no_progress,
                          on_score=keep)
    rows, by_position = tables(scores).values()
    baselines = compressor_baselines([doc.utf8 for doc in documents])
    base_rows = [{**dataclasses.asdict(b), "bits_per_byte": b.bits_per_byte} for b in baselines]
    columns = ["model", "context_length", "context_bytes", "stride", "windows",
               "longest_window", "bits_per_byte", "perplexity", "seconds"]
    if args.score_from is not None:
        columns[-1:-1] = ["scored_bytes", "scored_bits_per_byte"]
    for table in ([by_position] if by_position else []) + [rows, base_rows]:
        print(format_table(table, columns if table is rows else None))
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
        training_lengths={m.label: m.training_length for m in models})
    write_settings(args, models, context_lengths=lengths,
                   documents=[d.doc_id for d in documents])
    written = [out / "perplexity.csv", out / "compressors.csv", out / "perplexity.png"]
    if by_position:
        written += [out / "positions.csv", plot_bits_by_position(
            {f"{s.model.label} @ {s.result.context_length}": [
                (r["start"], r["end"], r["bits_per_byte"]) for r in by_position
                if r["model"] == s.model.label and r["context_length"] == s.result.context_length
            ] for s in scores},
            out / "positions.png",
            title=f"Bits per byte by position ({len(documents)} {args.split} documents)")]
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def write_tables(out: Path, tables: dict[str, list[dict[str, Any]]]) -> None:
    """Write each non-empty table (``{file name: rows}``) into ``out``, each whole."""
    for name, rows in tables.items():
        if rows:
            write_csv(rows, out / name)


def passkey_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_out="runs/eval/passkey")
    add_length_arguments(parser, "lengths", "max-length", "example lengths in bytes")
    parser.add_argument(
        "--depths", nargs="+", type=float_argument(0, 1), default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] (0 = start of the filler, 1 = just before the question)")
    parser.add_argument("--num-examples", type=positive_int_argument, default=10,
                        help="examples per cell")
    parser.add_argument("--num-digits", default=5, help="digits of the pass key (1-18)",
                        type=argument_type(int_between(1, 18), "an integer in [1, 18]"))


def check_depths_apart(lengths: list[int], depths: list[float], num_digits: int) -> None:
    """Refuse a length whose filler puts the needles of two ``depths`` on the same bytes
    (``longnet.data.synthetic.needle_window``)."""
    for length in lengths:
        budget, seen = length - min_passkey_length(num_digits), {}
        for depth in depths:
            window = needle_window(budget, depth)
            if window in seen:
                raise UsageError(
                    f"--lengths {length}: its filler of {budget} byte(s) puts the needle of depths "
                    f"{seen[window]:g} and {depth:g} on the same bytes ({window[0]} to "
                    f"{window[1]}); give longer lengths or fewer depths.")
            seen[window] = depth


def passkey(args: argparse.Namespace) -> int:
    """Passkey retrieval accuracy over a grid of context lengths x needle depths.

    Each cell's --num-examples prompts of that many bytes hide a --num-digits key at that
    depth; the model greedily generates the answer. Writes passkey.csv, passkey_generations.csv
    (every example), passkey.png, run.json and, for a dilated model, passkey_visibility.csv
    (accuracy by whether its heads see the copy).
    """
    check_output_folder(args.out, ["passkey.csv", "passkey_generations.csv", "passkey.png",
                                   "run.json", "passkey_visibility.csv"])
    models, out = models_from_args(args), args.out
    lengths = lengths_from_args(args, "lengths", "max-length", models)
    lengths, depths = check_passkey_grid(lengths, args.depths, args.num_digits)
    check_depths_apart(lengths, depths, args.num_digits)
    for item in models:  # refuse impossible lengths before any work
        for length in lengths:
            check_context_length(length, item.model)
    rows, example_rows, visibility_rows, grids = [], [], [], {}
    for item in models:
        cells: list[PasskeyCell] = []
        dilated = any(rate > 1 for _, rate in item.model.config.pattern.branches)
        for length in lengths:  # the CSV files are written as each length finishes
            done = evaluate_passkey(
                item.model, [length], depths, num_examples=args.num_examples, seed=args.seed,
                num_digits=args.num_digits, batch_size=args.batch_size,
                progress=False if args.no_progress else f"passkey {item.label}",
                tokenizer=item.tokenizer)
            cells += done
            new_rows, new_examples = passkey_rows(item.label, done, args.num_digits)
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
    for table in (rows, visibility_rows):
        if table:
            print(format_table(table))
    plot_passkey_heatmaps(grids, out / "passkey.png", title="Passkey retrieval accuracy "
                          f"({args.num_examples} examples per cell, greedy)")
    write_settings(args, models, lengths=lengths)
    written = ["passkey.csv", "passkey_generations.csv", "passkey.png"]
    if visibility_rows:
        written.append("passkey_visibility.csv")
    print("wrote " + ", ".join(str(out / name) for name in written))
    return 0


def harness_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_out="runs/eval/harness")
    parser.add_argument("--tasks", nargs="+", choices=HARNESS_TASKS, default=list(HARNESS_TASKS))
    parser.add_argument(
        "--context-length", type=length_argument,
        help="lm-eval's max_length for the bpb task (default: each model's max_positions)")
    parser.add_argument(
        "--niah-lengths", nargs="+", type=length_argument, metavar="LEN",
        help="NIAH example lengths in bytes, generated answer included (default: the context)")
    parser.add_argument("--niah-examples", type=positive_int_argument, default=20,
                        help="NIAH examples per task and length (RULER generates 500)")
    parser.add_argument("--compare", action="store_true",
                        help="also score the bpb documents as longnet eval perplexity does")
    add_document_arguments(parser)


def harness(args: argparse.Namespace) -> int:
    """LongNet models through EleutherAI's lm-eval, offline: bits per byte and RULER's NIAH.

    bpb: a loglikelihood_rolling task over the documents longnet eval perplexity scores
    (--compare adds that command's value); RULER's NIAH tasks at --niah-lengths. Writes
    harness.csv and run.json. Needs pip install -e ".[eval-harness]"; nothing is downloaded.
    """
    check_output_folder(args.out, ["harness.csv", "run.json"])
    offline()
    try:
        from longnet.hf.harness import BPB_TASK, NIAH_TASKS, evaluate_model
    except ModuleNotFoundError as err:  # lm-eval (or one of its own dependencies) is missing
        raise UsageError(f"longnet eval harness needs EleutherAI's lm-eval, and importing it "
                         f"failed ({err}); install it with pip install -e \".[eval-harness]\"."
                         ) from err
    models = models_from_args(args)
    documents = documents_from_args(args) if "bpb" in args.tasks else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="longnet-harness-") as work:  # tasks, tokenizer
        for index, loaded in enumerate(models):
            rows += evaluate_model(
                loaded, Path(work) / str(index), documents=documents,
                niah_tasks=[task for task in args.tasks if task in NIAH_TASKS],
                context_length=args.context_length, niah_lengths=args.niah_lengths or (),
                niah_examples=args.niah_examples, batch_size=args.batch_size,
                compare=args.compare, seed=args.seed)
            write_csv(rows, args.out / "harness.csv")
            print(f"{loaded.label}: done; {len(rows)} row(s) in {args.out / 'harness.csv'}",
                  flush=True)
    print(format_table(rows))
    write_settings(args, models,
                   documents=None if documents is None else [d.doc_id for d in documents])
    for loaded in models if args.compare and documents is not None else ():
        value = {r["task"]: r["value"] for r in rows if r["model"] == loaded.label
                 and r["metric"] in ("bits_per_byte", "scored_bits_per_byte")}
        print(f"{loaded.label}: lm-eval {value[BPB_TASK]:.6f}, longnet eval perplexity "
              f"{value['eval_perplexity']:.6f} bits per byte (difference "
              f"{value[BPB_TASK] - value['eval_perplexity']:+.2e})")
    print(f"wrote {args.out / 'harness.csv'}, {args.out / 'run.json'}")
    return 0


def offline() -> None:
    """Set ``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` where unset, also in the already
    imported huggingface_hub and datasets."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if name not in os.environ:
            os.environ[name] = "1"
            setattr(datasets.config, name, True)
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE
