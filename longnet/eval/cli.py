"""Command-line pieces shared by the evaluation scripts (``scripts/eval_*.py``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from longnet.eval.documents import EVAL_SPLITS, EvalDocument, load_eval_documents
from longnet.eval.loading import LoadedModel, load_models
from longnet.eval.perplexity import MIN_CONTEXT, default_context_lengths
from longnet.eval.reporting import parse_length
from longnet.files import refused_write, refused_write_line
from longnet.validation import (
    VERBOSE_FLAG,
    VERBOSE_HINT,
    UsageError,
    check_non_negative_int,
    check_positive_int,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class ScriptParser(argparse.ArgumentParser):
    """The argument parser of the scripts: a bad argument ends with one line naming it and the
    reason, and exit status 2, not the usage summary that buries it (``--help`` shows that);
    ``--verbose`` is accepted, before or after a subcommand (:func:`run_cli` reads it)."""

    verbose = False
    """Whether the command line parsed last gave ``--verbose``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(VERBOSE_FLAG, action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show its traceback too")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        ScriptParser.verbose = getattr(namespace, "verbose", False)
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message.rstrip('.')}; see {self.prog} --help.\n")


def json_object_argument(text: str) -> dict[str, Any]:
    """A JSON object (config overrides); ``argparse.ArgumentTypeError`` naming the text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object; write overrides as {{\"name\": value, ...}}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    """``--models``, ``--labels``, ``--overrides``, ``--device``, ``--dtype``,
    ``--batch-size``, ``--seed``, ``--out``, ``--no-progress``."""
    parser.add_argument(
        "--models", nargs="+", required=True, metavar="MODEL",
        help="zoo names, save_pretrained folders or Lightning .ckpt files",
    )
    parser.add_argument("--labels", nargs="+", help="names in tables/plots, one per model")
    parser.add_argument(
        "--overrides", nargs="+", type=json_object_argument, metavar="JSON",
        help="config overrides applied at load, one JSON object for all models or one per "
             "model, e.g. '{}' '{\"attention_sinks\": 4, \"select_top_k\": 16}' (folders and "
             "zoo names only)",
    )
    parser.add_argument("--device", type=device_argument, default="cpu",
                        help="cpu, cuda, cuda:1 or mps (default: cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=positive_int_argument, default=1,
                        help="sequences per forward pass")
    parser.add_argument("--seed", type=non_negative_int_argument, default=0,
                        help="seed of torch and of the examples")
    parser.add_argument("--out", type=path_argument, default=Path(default_out),
                        help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def add_length_arguments(
    parser: argparse.ArgumentParser, option: str, cap: str, what: str
) -> None:
    """``--<option>``: lengths like ``1K 4K 16K`` (``what`` they are, for the help), and
    ``--<cap>``: the cap of the default lengths (:func:`lengths_from_args`)."""
    parser.add_argument(
        f"--{option}", nargs="+", type=length_argument, metavar="LEN",
        help=f"{what}, e.g. 1K 4K 16K (default: powers of two from 1K to 16x the longest "
        f"training length, capped by --{cap})",
    )
    parser.add_argument(f"--{cap}", type=length_argument, help="cap of the default lengths")


def lengths_from_args(
    args: argparse.Namespace, option: str, cap: str, models: list[LoadedModel]
) -> list[int]:
    """The lengths of ``--<option>`` (:func:`add_length_arguments`), else those of
    :func:`longnet.eval.default_context_lengths` up to ``--<cap>``.

    Raises:
        UsageError: ``--<cap>`` leaves no default length.
    """
    given = getattr(args, option.replace("-", "_"))
    if given:
        return given
    limit = getattr(args, cap.replace("-", "_"))
    lengths = [n for n in default_context_lengths(models) if limit is None or n <= limit]
    if not lengths:
        raise UsageError(
            f"--{cap} {limit} leaves no default length (the shortest is {MIN_CONTEXT}); raise "
            f"it or give the lengths with --{option}."
        )
    return lengths


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data-files``, ``--corpus``, ``--text-column``, ``--split``, ``--val-fraction``,
    ``--test-fraction``, ``--max-documents``, ``--min-document-bytes``: which held-out
    documents to score (:func:`documents_from_args`)."""
    parser.add_argument("--data-files", nargs="+", help="text/json/parquet globs (default: stdlib)")
    parser.add_argument(
        "--corpus", nargs="+", metavar="ENTRY",
        help="offline corpus instead of --data-files: stdlib and/or installed distributions, "
        "e.g. --corpus stdlib sympy==1.14.0 (default: stdlib)",
    )
    parser.add_argument("--text-column", default="text", help="text column of json/parquet rows")
    parser.add_argument("--split", default="test", choices=list(EVAL_SPLITS),
                        help="held-out = validation + test (default: test)")
    fraction = float_argument(0, 1, exclusive=True)
    parser.add_argument("--val-fraction", type=fraction, default=0.05)
    parser.add_argument("--test-fraction", type=fraction, default=0.05)
    parser.add_argument("--max-documents", type=positive_int_argument,
                        help="read only the first N documents")
    parser.add_argument(
        "--min-document-bytes", type=non_negative_int_argument, default=0,
        help="evaluate only documents at least this long (e.g. the longest context)",
    )


def documents_from_args(args: argparse.Namespace) -> list[EvalDocument]:
    """The documents :func:`add_document_arguments` selects."""
    return load_eval_documents(
        args.data_files,
        corpus=args.corpus,
        split=args.split,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        text_column=args.text_column,
        max_documents=args.max_documents,
        min_bytes=args.min_document_bytes,
    )


def positive_int_argument(text: str) -> int:
    """argparse type for counts: an integer >= 1."""
    try:
        return check_positive_int("count", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}.") from None


def non_negative_int_argument(text: str) -> int:
    """argparse type for seeds and counts that may be 0: an integer >= 0."""
    try:
        return check_non_negative_int("count", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}.") from None


def float_argument(
    minimum: float, maximum: float = math.inf, *, exclusive: bool = False
) -> Callable[[str], float]:
    """argparse type for a finite number in ``[minimum, maximum]`` (``(minimum, maximum)`` when
    ``exclusive``): ``float_argument(0, exclusive=True)`` for seconds, ``float_argument(0, 1)``
    for a fraction. NaN and infinities are refused."""
    if math.isinf(maximum):
        bounds = f"{'>' if exclusive else '>='} {minimum:g}"
    else:
        opening, closing = "()" if exclusive else "[]"
        bounds = f"in {opening}{minimum:g}, {maximum:g}{closing}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = minimum < value < maximum if exclusive else minimum <= value <= maximum
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"expected a finite number {bounds}, got {text!r}.")
        return value

    return parse


def path_argument(text: str) -> Path:
    """argparse type for files and folders: any path but an empty one (which would mean the
    current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}.")
    return Path(text)


def device_argument(text: str) -> str:
    """argparse type for devices: ``cpu``, ``cuda``, ``cuda:1`` or ``mps``, one this machine
    has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; write cpu, cuda, cuda:1 or mps."
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        visible = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(
            f"{text}: this machine has {visible} visible CUDA device(s); use "
            f"{'--device cpu' if not visible else f'cuda:0 to cuda:{visible - 1}'}."
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available here; use --device cpu.")
    return text


def length_argument(text: str) -> int:
    """argparse type for lengths like ``2048``, ``16K``, ``1M``."""
    try:
        return parse_length(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def position_argument(text: str) -> int:
    """argparse type for positions in a document: ``0``, ``512``, ``16K``."""
    try:
        return parse_length(text, minimum=0)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def stride_argument(text: str) -> int | float:
    """argparse type: a token count (``512``, ``1K``) or a fraction of the context (``0.5``)."""
    try:
        if "." in text:
            value = float(text)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"a fractional stride must be in (0, 1], got {text!r}.")
            return value
        return parse_length(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def models_from_args(args: argparse.Namespace) -> list[LoadedModel]:
    """Seed torch and load ``--models`` on ``--device`` in ``--dtype``."""
    torch.manual_seed(args.seed)
    return load_models(args.models, device=torch.device(args.device), dtype=DTYPES[args.dtype],
                       labels=args.labels, overrides=args.overrides)


def run_cli(main: Callable[[], int]) -> int:
    """Run a script's ``main``; bad arguments or inputs (``ValueError``, ``FileNotFoundError``)
    and a write the machine refused (``longnet.files.refused_write``: no room, a read-only file
    system) end as the ``longnet`` command ends them: their message, a line naming
    ``--verbose`` (given to a :class:`ScriptParser`, it prints the traceback too) and exit
    status 2. Any other error keeps its traceback."""
    try:
        return main()
    except (ValueError, OSError) as err:
        if isinstance(err, OSError) and not (isinstance(err, FileNotFoundError)
                                             or refused_write(err)):
            raise
        if ScriptParser.verbose:
            traceback.print_exc()
        line = refused_write_line(err) if refused_write(err) else f"error: {err}"
        print(f"{line}\n{VERBOSE_HINT}", file=sys.stderr)
        return 2
