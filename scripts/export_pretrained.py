"""Write the model of a Lightning checkpoint as a ``save_pretrained`` folder.

    python scripts/export_pretrained.py CHECKPOINT OUTPUT

``CHECKPOINT``: a ``.ckpt`` file (one process, ``SequenceParallelStrategy``) or a folder of
shards (``ShardedSequenceParallelStrategy``, written by every rank; read here on one process,
whatever the world size that wrote it). ``OUTPUT`` gets ``config.json``, ``model.safetensors``
and a card, loadable with ``LongNetLM.from_pretrained(OUTPUT)``.
"""

from __future__ import annotations

import argparse

from longnet.training.checkpoint import export_pretrained


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file or a folder of shards")
    parser.add_argument("output", help="destination folder")
    args = parser.parse_args(argv)
    print(export_pretrained(args.checkpoint, args.output))


if __name__ == "__main__":
    main()
