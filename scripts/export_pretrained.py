"""Write the model of a Lightning checkpoint as a ``save_pretrained`` folder.

    python scripts/export_pretrained.py CHECKPOINT OUTPUT [--overwrite]

``CHECKPOINT``: a ``.ckpt`` file (one process, ``SequenceParallelStrategy``) or a folder of
shards (``ShardedSequenceParallelStrategy``, written by every rank; read here on one process,
whatever the world size that wrote it), or the LoRA delta folder a LoRA fine-tune exports
(``lora.json``; a LoRA checkpoint too is written merged into its base). ``OUTPUT`` gets
``config.json``, ``model.safetensors`` and a card (and a delta folder's tokenizer files),
loadable with ``LongNetLM.from_pretrained(OUTPUT)``, written into a temporary folder next to
it that then takes its place whole. An ``OUTPUT`` that holds a model or checkpoint is refused
unless ``--overwrite`` is given; one that is, holds or is inside ``CHECKPOINT`` or the LoRA
base of a LoRA run is refused even then; so are an empty ``OUTPUT``, the current folder and a
folder holding it. A LoRA delta or checkpoint is merged only into the base it was trained over
(the weights fingerprint it records). ``OUTPUT`` is checked before the model is built and is
left as it was on any error; errors end with a message and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from longnet.eval.cli import ScriptParser, run_cli
from longnet.files import check_path_given
from longnet.training.checkpoint import export_pretrained
from longnet.training.lora import DELTA_CONFIG, merge_delta


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file, a folder of shards or a LoRA delta "
                        "folder")
    parser.add_argument("output", help="destination folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an OUTPUT that holds a model or checkpoint")
    args = parser.parse_args(argv)  # strings: an empty one is refused, not taken as "."
    check_path_given(args.output, "OUTPUT")
    check_path_given(args.checkpoint, "CHECKPOINT")
    if (Path(args.checkpoint) / DELTA_CONFIG).is_file():
        print(merge_delta(args.checkpoint, args.output, overwrite=args.overwrite))
    else:
        print(export_pretrained(args.checkpoint, args.output, overwrite=args.overwrite))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
