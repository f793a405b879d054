"""Hand a training run over between chunks on machines that share nothing.

    python -m lab.scripts.chunk_state pack CHECKPOINT FOLDER [--max-shard-size 16M] [--max-files 8]
                                       [--overwrite]
    python -m lab.scripts.chunk_state unpack FOLDER CHECKPOINT [--overwrite]
    python -m lab.scripts.chunk_state handoff CHECKPOINT FOLDER [--overwrite]
    python -m lab.scripts.chunk_state start FOLDER CHECKPOINT [--overwrite]
    python -m lab.scripts.chunk_state restore CHECKPOINT [--state FOLDER] [--handoff FOLDER]

``pack``: the full state, ``CHECKPOINT`` (a ``last.ckpt``) cut into shards of at most
``--max-shard-size`` bytes next to ``index.json``, at most ``--max-files`` files in all;
``unpack`` puts it back together byte for byte (a resume from it is bit-exact). ``handoff``:
the compact handoff, bfloat16 weights and ``handoff.json`` (step, data position, schedule),
small enough to commit; ``start`` makes of it a checkpoint with fresh optimizer moments
(``longnet.training.Rewarmup`` ramps the learning rate back up). ``restore`` makes
``CHECKPOINT`` the newest of what is there: ``CHECKPOINT`` itself, the full state in
``--state``, the handoff in ``--handoff`` (the higher step; at equal steps in that order),
and says which; with none of them it says so (a new run). A folder given must exist, and a
state or handoff of another run (run id, model shape) is refused: ``CHECKPOINT`` is kept.
The training time the earlier chunks recorded for ``trainer.max_time`` is zeroed in the
checkpoint restored, so that each chunk's ``max_time`` counts that chunk alone. ``pack``,
``unpack``, ``handoff`` and ``start`` refuse a target that already holds a pack, a handoff or a
checkpoint unless ``--overwrite`` is given, and ``unpack`` and ``start`` replace a checkpoint
only by the same run's (run id, model shape), ``--overwrite`` or not; a target that is, holds
or is inside what is read is always refused. A refused target is left as it was.
``longnet fit --ckpt_path last`` continues from ``<run folder>/checkpoints/last.ckpt``. See
docs/long_context_gpu.md. Errors end with two lines (the message, then how ``--verbose``
shows the traceback) and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import longnet.cli.command  # noqa: F401 - a zoo model's first use imports it, as under `longnet`
from lab.handoff import (
    MAX_FILES,
    MAX_SHARD_SIZE,
    handoff_checkpoint,
    pack_state,
    restart_clock,
    restore_newest,
    unpack_state,
    write_handoff,
)
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import length_argument, path_argument, positive_int_argument


def describe(files: list[Path]) -> str:
    """One line: how many files, their total size and each file with its size."""
    sizes = [path.stat().st_size for path in files]
    listed = ", ".join(f"{path.name} ({size:,} bytes)" for path, size in zip(files, sizes))
    return f"{len(files)} files, {sum(sizes) / 2**20:.1f} MiB in {files[0].parent}: {listed}"


def restored(target: Path, state: Path | None, handoff: Path | None) -> str:
    """``restore_newest``, said in a line."""
    found = restore_newest(target, state, handoff)
    if found is None:
        return f"no checkpoint, full state or handoff found: {target} is not written (a new run)."
    kind, step = found
    source = {"checkpoint": "kept as it is", "state": f"unpacked from the full state in {state}",
              "handoff": f"made from the compact handoff in {handoff} (fresh optimizer "
                         "moments)"}[kind]
    seconds = restart_clock(target)
    clock = (f" The earlier chunks' {seconds:.0f} s of training no longer count against "
             "max_time." if seconds else "")
    return f"{target}: step {step}, {source}.{clock}"


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack = commands.add_parser("pack", help="the full state as shards + index.json")
    pack.add_argument("checkpoint", type=path_argument,
                      help="a Lightning checkpoint file (last.ckpt)")
    pack.add_argument("folder", type=path_argument, help="where the shards go")
    pack.add_argument("--max-shard-size", type=length_argument, default=MAX_SHARD_SIZE,
                      help="bytes per shard, e.g. 16M (default: 16M)")
    pack.add_argument("--max-files", type=positive_int_argument, default=MAX_FILES,
                      help=f"most files written, index included (default: {MAX_FILES})")
    pack.add_argument("--overwrite", action="store_true", help="replace an earlier pack")
    unpack = commands.add_parser("unpack", help="the full state back into a checkpoint")
    unpack.add_argument("folder", type=path_argument, help="a folder written by pack")
    unpack.add_argument("checkpoint", type=path_argument, help="the checkpoint file to write")
    unpack.add_argument("--overwrite", action="store_true",
                        help="replace an existing checkpoint (of the same run only)")
    handoff = commands.add_parser("handoff", help="the compact handoff of a checkpoint")
    handoff.add_argument("checkpoint", type=path_argument,
                         help="a Lightning checkpoint file (last.ckpt)")
    handoff.add_argument("folder", type=path_argument, help="where the handoff goes")
    handoff.add_argument("--overwrite", action="store_true", help="replace an earlier handoff")
    start = commands.add_parser("start", help="a checkpoint to start a chunk from a handoff")
    start.add_argument("folder", type=path_argument, help="a folder written by handoff")
    start.add_argument("checkpoint", type=path_argument, help="the checkpoint file to write")
    start.add_argument("--overwrite", action="store_true",
                       help="replace an existing checkpoint (of the same run only)")
    newest = commands.add_parser("restore", help="the newest handover present, as checkpoint")
    newest.add_argument("checkpoint", type=path_argument, help="<run folder>/checkpoints/last.ckpt")
    newest.add_argument("--state", type=path_argument, help="a folder written by pack")
    newest.add_argument("--handoff", type=path_argument, help="a folder written by handoff")
    args = parser.parse_args(argv)

    if args.command == "pack":
        files = pack_state(args.checkpoint, args.folder, max_shard_size=args.max_shard_size,
                           max_files=args.max_files, overwrite=args.overwrite)
        print(f"packed {args.checkpoint} into {describe(files)}")
    elif args.command == "unpack":
        print(f"unpacked {unpack_state(args.folder, args.checkpoint, overwrite=args.overwrite)}")
    elif args.command == "handoff":
        files = write_handoff(args.checkpoint, args.folder, overwrite=args.overwrite)
        print(f"handoff of {args.checkpoint}: {describe(files)}")
    elif args.command == "start":
        written = handoff_checkpoint(args.folder, args.checkpoint, overwrite=args.overwrite)
        print(f"wrote {written}: resume it with "
              "longnet fit --ckpt_path (fresh optimizer moments; Rewarmup ramps the rate)")
    else:
        print(restored(args.checkpoint, args.state, args.handoff))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
