"""Hand a training run over between time-boxed chunks on machines that share nothing.

A chunk trains for a while (``trainer.max_time``) and ends with ``last.ckpt``; the next chunk,
on a fresh machine, continues from one of two handovers (``docs/long_context_gpu.md``):

- **the full state** (:func:`pack_state`, :func:`unpack_state`): ``last.ckpt`` itself, cut
  into shards of at most ``max_shard_size`` bytes (``state-00001-of-00003.bin``, ...) next to
  ``index.json`` (each shard's size and SHA-256, and the whole file's), put back together
  byte for byte. Weights, AdamW moments, data position and RNG are the ones the run saved, so
  ``longnet fit --ckpt_path last`` from it continues bit-exactly.
- **the compact handoff** (:func:`write_handoff`, :func:`handoff_checkpoint`): the weights in
  bfloat16 (``weights.safetensors``) and ``handoff.json`` (step, data position, learning-rate
  schedule, optimizer hyper-parameters, run id, the callbacks' plain states): small enough to
  commit (about 2 bytes per parameter); ``handoff.json`` records the weights' size and
  SHA-256, checked when read. :func:`handoff_checkpoint` turns it into a checkpoint
  that ``--ckpt_path`` resumes with the weights widened back to their dtype and the AdamW
  moments empty; :class:`Rewarmup` then ramps the learning rate back up over a few steps,
  and the schedule and the data order continue from the recorded step.

Neither depends on anything else the earlier chunk left behind (caches, run folders).

Every writer here refuses, before any work, a target that holds a checkpoint, a pack or a
handoff unless asked to replace it (``overwrite``), and one that is, holds or is inside what it
reads, even then (:func:`longnet.files.check_target`); a checkpoint is replaced only by the same
run's (run id, model shape). A refused or failed write leaves the target as it was.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from lab.handoff_tokenizer import record_by_name, record_with_files
from longnet.files import check_path_given, check_target, replace_folder, write_atomic
from longnet.modeling.serialization import parse_safetensors
from longnet.training.checkpoint import STATE_DICT, read_checkpoint
from longnet.training.lora import LORA_BASE_KEY
from longnet.training.run_folder import RUN_ID_KEY, checkpoint_run_id
from longnet.training.vocabulary import TOKENIZER_KEY
from longnet.validation import UsageError, check_positive_int, is_int

MiB = 1 << 20
MAX_SHARD_SIZE = 16 * MiB
"""Largest shard :func:`pack_state` writes by default (what a device machine gives back)."""
MAX_FILES = 8
"""Most files :func:`pack_state` writes by default, ``index.json`` included."""
INDEX = "index.json"
HANDOFF = "handoff.json"
WEIGHTS = "weights.safetensors"
STATE_FORMAT = "longnet-chunk-state"
HANDOFF_FORMAT = "longnet-handoff"
HANDOFF_ENTRIES = ("epoch", "global_step", "pytorch-lightning_version", "loops",
                   "lr_schedulers", "hparams_name", "hyper_parameters",
                   "datamodule_hparams_name", "datamodule_hyper_parameters", RUN_ID_KEY,
                   TOKENIZER_KEY, LORA_BASE_KEY)
"""The checkpoint entries a compact handoff keeps as they are (plain values): what Lightning
needs to resume ``fit`` at the recorded step (loops with the data position, schedulers), the
module's and datamodule's hyper-parameters, the run id and the tokenizer (its fingerprint,
checked on resume, and its files, which exports write; a zoo tokenizer's files are left out
and read back from the zoo entry by name: 3.4 MB of JSON for SmolLM2's) and a LoRA run's base
(its weights fingerprint, checked on resume)."""


# ---------------------------------------------------------------------- the full state
def pack_state(checkpoint: str | Path, folder: str | Path, *,
               max_shard_size: int = MAX_SHARD_SIZE, max_files: int = MAX_FILES,
               overwrite: bool = False) -> list[Path]:
    """Cut the checkpoint file ``checkpoint`` into shards of at most ``max_shard_size`` bytes
    in ``folder``, next to ``index.json``; returns the files written (index first).

    ``folder`` is replaced whole (an earlier pack's shards do not survive); it must be absent,
    empty or, with ``overwrite``, an earlier pack.

    Raises:
        UsageError: ``checkpoint`` is not a Lightning checkpoint file, ``folder`` holds other
            files, an earlier pack (without ``overwrite``) or ``checkpoint``, or the shards
            and the index would be more than ``max_files`` files.
    """
    check_positive_int("max_shard_size", max_shard_size)
    check_positive_int("max_files", max_files)
    checkpoint, folder = Path(checkpoint), Path(folder)
    if checkpoint.is_dir():
        raise UsageError(f"{checkpoint} is a folder of shards; pack_state takes a checkpoint "
                         "file (<run folder>/checkpoints/last.ckpt of a one-process run).")
    old = _check_folder(folder, INDEX, checkpoint, overwrite)
    step = read_checkpoint(checkpoint, tensors=False).get("global_step")
    data = checkpoint.read_bytes()
    count = max(1, math.ceil(len(data) / max_shard_size))
    if count + 1 > max_files:
        raise UsageError(
            f"{checkpoint} ({len(data):,} bytes) needs {count} shards of at most "
            f"{max_shard_size:,} bytes plus {INDEX}: {count + 1} files, more than max_files "
            f"{max_files}. Hand it over with the compact handoff instead (lab.scripts.chunk_state "
            "handoff), or allow larger shards or more files where the transport permits."
        )
    names = [f"state-{k:05d}-of-{count:05d}.bin" for k in range(1, count + 1)]
    shards = [data[k * max_shard_size:(k + 1) * max_shard_size] for k in range(count)]
    index = {
        "format": STATE_FORMAT, "version": 1, "file": checkpoint.name, "global_step": step,
        "size": len(data), "sha256": _sha256(data),
        "shards": [{"name": name, "size": len(shard), "sha256": _sha256(shard)}
                   for name, shard in zip(names, shards)],
    }
    with replace_folder(folder, owned=old) as temp:
        for name, shard in zip(names, shards):
            (temp / name).write_bytes(shard)
        (temp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [folder / INDEX, *(folder / name for name in names)]


def unpack_state(folder: str | Path, target: str | Path, *, overwrite: bool = False) -> Path:
    """Put the checkpoint packed in ``folder`` (:func:`pack_state`) back together at
    ``target``, byte for byte (every shard's size and SHA-256 checked, and the whole file's);
    returns ``target``, written whole or not at all.

    Raises:
        FileNotFoundError: no ``index.json`` in ``folder``.
        UsageError: the index is not one :func:`pack_state` wrote, or a shard is missing,
            of another size or damaged, or the whole is (the message names it); a ``target``
            refused by :func:`_write_checkpoint` (a folder, an existing checkpoint without
            ``overwrite``, another run's with it).
    """
    return _write_checkpoint(Path(folder), target, _state_bytes, overwrite)


def _state_bytes(folder: Path) -> bytes:
    """The checkpoint packed in ``folder``, checked (:func:`unpack_state`)."""
    index = _read_index(folder)
    parts = []
    for shard in index["shards"]:
        path = folder / shard["name"]
        if not path.is_file():
            raise UsageError(f"{path} is missing: {INDEX} lists {len(index['shards'])} shards. "
                             "Copy every file of the packed state into the folder.")
        data = path.read_bytes()
        if len(data) != shard["size"] or _sha256(data) != shard["sha256"]:
            raise UsageError(f"{path} is damaged: {len(data):,} bytes with another SHA-256 "
                             f"than the {shard['size']:,} bytes {INDEX} records. Copy it again.")
        parts.append(data)
    data = b"".join(parts)
    if len(data) != index["size"] or _sha256(data) != index["sha256"]:
        raise UsageError(f"the shards in {folder} make {len(data):,} bytes with another SHA-256 "
                         f"than the {index['size']:,} bytes of {index['file']} that {INDEX} "
                         "records: the shards come from different packs. Copy the folder "
                         "again, whole.")
    return data


# ---------------------------------------------------------------------- the compact handoff
def write_handoff(checkpoint: str | Path, folder: str | Path, *,
                  overwrite: bool = False) -> list[Path]:
    """Write the compact handoff of the Lightning checkpoint ``checkpoint`` into ``folder``
    (replaced whole): ``weights.safetensors`` (the module's floating-point tensors in
    bfloat16, the others as they are) and ``handoff.json`` (module docstring); returns both.

    Raises:
        UsageError: ``checkpoint`` is not a Lightning checkpoint with optimizer states, or one
            of the entries kept holds something other than plain values (JSON); ``folder``
            holds other files, an earlier handoff (without ``overwrite``) or ``checkpoint``.
    """
    checkpoint = Path(checkpoint)
    old = _check_folder(Path(folder), HANDOFF, checkpoint, overwrite)
    state = read_checkpoint(checkpoint)
    if not state.get("optimizer_states"):
        raise UsageError(f"{checkpoint} holds no optimizer state (a weights-only checkpoint): "
                         "hand over a checkpoint of LastCheckpoint (<run>/checkpoints/last.ckpt).")
    weights = {name: _compact(tensor) for name, tensor in state[STATE_DICT].items()}
    handoff = {
        "format": HANDOFF_FORMAT, "version": 1,
        "dtypes": {name: str(tensor.dtype).removeprefix("torch.")
                   for name, tensor in state[STATE_DICT].items()},
        "param_groups": [optimizer["param_groups"] for optimizer in state["optimizer_states"]],
        "callbacks": {key: value for key, value in (state.get("callbacks") or {}).items()
                      if not _file_bound(value)},
        "checkpoint": {key: state[key] for key in HANDOFF_ENTRIES if key in state},
    }
    if TOKENIZER_KEY in handoff["checkpoint"]:
        handoff["checkpoint"][TOKENIZER_KEY] = record_by_name(state[TOKENIZER_KEY])
    data = save(weights, metadata={"format": "pt", "library": "longnet"})
    handoff["weights"] = {"size": len(data), "sha256": _sha256(data)}
    text = _to_json(handoff, checkpoint)
    with replace_folder(folder, owned=old) as temp:
        (temp / WEIGHTS).write_bytes(data)
        (temp / HANDOFF).write_text(text)
    return [Path(folder) / WEIGHTS, Path(folder) / HANDOFF]


def handoff_checkpoint(folder: str | Path, target: str | Path, *,
                       overwrite: bool = False) -> Path:
    """Write at ``target`` a Lightning checkpoint made from the compact handoff in ``folder``
    (:func:`write_handoff`): the weights widened back to their dtypes, the recorded step, data
    position, schedule, run id and callback states, and each optimizer's hyper-parameters
    with no moments (AdamW starts them afresh; :class:`Rewarmup` ramps the learning rate).
    ``longnet fit --ckpt_path`` resumes from it; returns ``target``.

    Raises:
        FileNotFoundError: no ``handoff.json`` or ``weights.safetensors`` in ``folder``.
        UsageError: ``handoff.json`` is not one :func:`write_handoff` wrote, the weights
            are not the ones it records (size, SHA-256) or do not match its tensor list, or
            the zoo tokenizer it names cannot be read here as recorded
            (``handoff_tokenizer.record_with_files``); a ``target`` refused by
            :func:`_write_checkpoint` (a folder, an existing checkpoint without ``overwrite``,
            another run's with it: ``start`` never replaces another run's only checkpoint).
    """
    return _write_checkpoint(Path(folder), target, _handoff_bytes, overwrite)


def _write_checkpoint(source: Path, target: str | Path, data_of: Callable[[Path], bytes],
                      overwrite: bool) -> Path:
    """Write at ``target`` the checkpoint ``data_of(source)`` makes; returns ``target``.

    Refused before any work: a ``target`` that is a folder, that holds a file (unless
    ``overwrite``) or that is a file of ``source`` (even then). With ``overwrite``, an existing
    checkpoint is replaced only by the same run's (:func:`_check_same_run`); a file that is no
    checkpoint is replaced.
    """
    existing = os.path.lexists(target)  # a new file next to the folder's own is no harm
    target = check_target(target, sources={"the folder read": source} if existing else None,
                          overwrite=overwrite, what="CHECKPOINT", kind="file")
    data = data_of(source)
    if target.is_file():
        try:
            mine = read_checkpoint(target)
        except UsageError:  # no checkpoint: no run to keep
            mine = None
        if mine is not None:
            theirs = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            _check_same_run(source, theirs, target, mine, target)
    return write_atomic(target, data)


def _handoff_bytes(folder: Path) -> bytes:
    """The checkpoint :func:`handoff_checkpoint` writes, as bytes."""
    handoff = _read_handoff(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS} in {folder}: copy it next to {HANDOFF}.")
    data = path.read_bytes()
    recorded = handoff.get("weights")
    if recorded is not None and (len(data), _sha256(data)) != (recorded["size"],
                                                               recorded["sha256"]):
        raise UsageError(f"{path} is damaged: {len(data):,} bytes with another SHA-256 than "
                         f"the {recorded['size']:,} bytes {HANDOFF} records. Copy it again.")
    tensors = parse_safetensors(data, path)
    dtypes = handoff["dtypes"]
    if set(tensors) != set(dtypes):
        missing, extra = sorted(set(dtypes) - set(tensors)), sorted(set(tensors) - set(dtypes))
        raise UsageError(f"{folder / WEIGHTS} does not hold the tensors {HANDOFF} lists "
                         f"(missing: {missing[:3]}, unknown: {extra[:3]}): the two files come "
                         "from different handoffs.")
    entries = dict(handoff["checkpoint"])
    if TOKENIZER_KEY in entries:
        entries[TOKENIZER_KEY] = record_with_files(entries[TOKENIZER_KEY], str(folder / HANDOFF))
    checkpoint = {
        **entries,
        STATE_DICT: {name: tensor.to(_dtype(dtypes[name], folder / HANDOFF))
                     for name, tensor in tensors.items()},
        "optimizer_states": [{"state": {}, "param_groups": groups}
                             for groups in handoff["param_groups"]],
        "callbacks": handoff["callbacks"],
    }
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def restore_newest(target: str | Path, state: str | Path | None = None,
                   handoff: str | Path | None = None) -> tuple[str, int] | None:
    """Make the checkpoint file ``target`` the newest handover present: ``target`` itself (a
    chunk's own ``last.ckpt``), the full state packed in the folder ``state`` (unpacked) or the
    compact handoff in the folder ``handoff`` (made a checkpoint); the highest step wins, at
    equal steps in that order (the exact ones first). Returns which (``"checkpoint"``,
    ``"state"`` or ``"handoff"``) and its step; None when there is none of them (a new run).

    ``target`` is replaced only by the same run's newer state: a newest ``state`` or
    ``handoff`` of another run (another run id or model shape) than ``target`` or the other
    folder given is refused, and ``target`` kept.

    Raises:
        FileNotFoundError: ``state`` or ``handoff`` given but absent, or without its
            ``index.json`` / ``handoff.json``.
        UsageError: ``state`` or ``handoff`` is a file or another run's, as
            :func:`unpack_state` and :func:`handoff_checkpoint`, or a ``target`` that is not a
            checkpoint.
    """
    target = check_target(target, overwrite=True, what="CHECKPOINT", kind="file")
    found = []
    if target.is_file():
        step = read_checkpoint(target, tensors=False).get("global_step")
        found.append((step or 0, 2, "checkpoint", target))
    if state is not None:
        index = _read_index(_given_folder(state, "state folder", "lab.scripts.chunk_state pack"))
        found.append((index["global_step"] or 0, 1, "state", Path(state)))
    if handoff is not None:
        recorded = _read_handoff(_given_folder(handoff, "handoff folder",
                                               "lab.scripts.chunk_state handoff"))
        found.append((recorded["checkpoint"]["global_step"] or 0, 0, "handoff", Path(handoff)))
    if not found:
        return None
    step, _, kind, source = max(found)
    if kind != "checkpoint":
        data = _state_bytes(source) if kind == "state" else _handoff_bytes(source)
        newest = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        for *_, other_kind, other in found:  # everything else given: the same run
            if other != source:
                _check_same_run(source, newest, other, _read_as_checkpoint(other_kind, other),
                                target)
        write_atomic(target, data)
    return kind, step


def restart_clock(checkpoint: str | Path) -> float:
    """Zero the training time that Lightning's ``Timer`` (``trainer.max_time``) recorded in
    the checkpoint file ``checkpoint``, so that the next fit's ``max_time`` counts that fit
    alone. Lightning adds the recorded time on a resume: a chunk of ``max_time`` resumed from
    one that used up ``max_time`` would stop after its first step. Returns the seconds
    removed; 0.0 leaves the file as it was (no ``Timer`` state, or no time recorded).
    """
    path = Path(checkpoint)
    state = read_checkpoint(path)
    elapsed = ((state.get("callbacks") or {}).get("Timer") or {}).get("time_elapsed") or {}
    seconds = float(elapsed.get("train") or 0.0)
    if seconds == 0.0:
        return 0.0
    elapsed["train"] = 0.0
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())
    return seconds


# ---------------------------------------------------------------------- helpers
def _check_folder(folder: Path, marker: str, source: Path, overwrite: bool) -> set[str]:
    """Refuse a ``folder`` that is a file, that holds files and no ``marker`` (another
    writer's folder), that holds an earlier pack or handoff (one with ``marker``) and not
    ``overwrite``, or that is, holds or is inside ``source`` (what is written there comes
    from it); returns its file names."""
    if os.path.lexists(folder) and not folder.is_dir():
        raise UsageError(f"{folder} is a file, not a folder; give a folder path.")
    names = set(os.listdir(folder)) if folder.is_dir() else set()
    if names and marker not in names:
        raise UsageError(f"{folder} holds other files ({', '.join(sorted(names)[:4])}); give "
                         f"an empty or new folder, or one with an earlier {marker}.")
    check_target(folder, sources={"the checkpoint": source}, overwrite=overwrite, what="FOLDER")
    return names


def _given_folder(path: str | Path, what: str, writer: str) -> Path:
    """``path``, a folder given as ``what``: refused when absent or a file."""
    path = check_path_given(path, what)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist; give the folder written by "
                                f"{writer}, or leave it out when there is none.")
    if not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder; give the folder written by "
                         f"{writer}.")
    return path


def _read_as_checkpoint(kind: str, source: Path) -> Mapping[str, Any]:
    """The checkpoint ``source`` is or makes (``kind``: as :func:`restore_newest` names it)."""
    if kind == "checkpoint":
        return read_checkpoint(source)
    data = _state_bytes(source) if kind == "state" else _handoff_bytes(source)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _check_same_run(source: Path, theirs: Mapping[str, Any], other: Path,
                    mine: Mapping[str, Any], target: Path) -> None:
    """Refuse to write at ``target`` the checkpoint ``theirs``, made from ``source``, when
    ``mine``, the one ``other`` (``target``, or the other folder given) holds, is of another
    run: another run id or other tensor shapes."""
    differences = []
    ids = checkpoint_run_id(mine), checkpoint_run_id(theirs)
    if None not in ids and ids[0] != ids[1]:
        differences.append(f"run id {ids[1]} at step {theirs.get('global_step')}, {other} "
                           f"run id {ids[0]} at step {mine.get('global_step')}")
    shapes = _shapes(mine), _shapes(theirs)
    changed = sorted(name for name in {*shapes[0], *shapes[1]}
                     if shapes[0].get(name) != shapes[1].get(name))
    if changed:
        name = changed[0]
        differences.append(f"{len(changed)} tensor(s) of other shapes, e.g. {name}: "
                           f"{shapes[1].get(name)} against {shapes[0].get(name)}")
    if differences:
        raise UsageError(
            f"{source} holds another run than {other} ({'; '.join(differences)}). Nothing "
            f"was written: {target} is kept as it was. To start from {source} instead, move "
            f"{other} away first; else give this run's own state or handoff."
        )


def _shapes(checkpoint: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in checkpoint[STATE_DICT].items()
            if isinstance(value, torch.Tensor)}


def _read_index(folder: Path) -> dict[str, Any]:
    """``folder``'s ``index.json`` (:func:`pack_state`), checked to hold every entry read."""
    index = _read_json(folder / INDEX, STATE_FORMAT, "lab.scripts.chunk_state pack")
    shards = index.get("shards")
    complete = (
        isinstance(shards, list) and bool(shards)
        and all(isinstance(shard, dict) and isinstance(shard.get("name"), str)
                and shard["name"] == Path(shard["name"]).name and is_int(shard.get("size"))
                and isinstance(shard.get("sha256"), str) for shard in shards)
        and isinstance(index.get("file"), str) and is_int(index.get("size"))
        and isinstance(index.get("sha256"), str)
        and (index.get("global_step") is None or is_int(index["global_step"]))
    )
    if not complete:
        raise UsageError(f"{folder / INDEX} lacks entries lab.scripts.chunk_state pack writes "
                         "(shards, each with name, size and sha256; the file's name, size, "
                         "sha256 and global_step): it is damaged. Copy it again, or pack the "
                         "checkpoint again.")
    index.setdefault("global_step", None)
    return index


def _read_handoff(folder: Path) -> dict[str, Any]:
    """``folder``'s ``handoff.json`` (:func:`write_handoff`), checked to hold every entry
    read."""
    handoff = _read_json(folder / HANDOFF, HANDOFF_FORMAT, "lab.scripts.chunk_state handoff")
    kinds = {"dtypes": dict, "param_groups": list, "callbacks": dict, "checkpoint": dict}
    checkpoint, weights = handoff.get("checkpoint"), handoff.get("weights")
    complete = (
        all(isinstance(handoff.get(key), kind) for key, kind in kinds.items())
        and (checkpoint.get("global_step") is None or is_int(checkpoint["global_step"]))
        and (weights is None  # handoffs written before the weights' record
             or (isinstance(weights, dict) and is_int(weights.get("size"))
                 and isinstance(weights.get("sha256"), str)))
    )
    if not complete:
        raise UsageError(f"{folder / HANDOFF} lacks entries lab.scripts.chunk_state handoff "
                         f"writes ({', '.join(kinds)}, with the step): it is damaged. Copy it "
                         "again, or write the handoff again.")
    handoff["checkpoint"].setdefault("global_step", None)
    return handoff


def _dtype(name: Any, source: Path) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``), as ``handoff.json`` records them."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"{source} names {name!r} as a tensor's dtype, which is not a torch "
                         "dtype (e.g. float32); the file is damaged.")
    return dtype


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A bfloat16 copy of a floating-point tensor, a copy of any other (safetensors refuses
    tensors that share memory, as tied embeddings do)."""
    dtype = torch.bfloat16 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(dtype, copy=True).contiguous()


def _file_bound(state: Any) -> bool:
    """Whether a callback state is a ``ModelCheckpoint``'s (it names files of the machine that
    wrote it; the next chunk's run folder starts its own)."""
    return isinstance(state, Mapping) and "best_k_models" in state


def _to_json(value: Any, source: Path) -> str:
    def refuse(item: Any) -> Any:
        raise UsageError(f"{source}: cannot write {type(item).__name__} {item!r:.80} into "
                         f"{HANDOFF}: the entries kept must be plain values (numbers, text, "
                         "lists, mappings).")

    return json.dumps(value, indent=1, default=refuse) + "\n"


def _read_json(path: Path, kind: str, writer: str) -> dict[str, Any]:
    """The JSON file ``path``, checked to be a ``kind`` document."""
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}: not a folder written by "
                                f"{writer}.")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path} is not valid JSON ({err}); copy it again.") from None
    if not isinstance(data, dict) or data.get("format") != kind:
        raise UsageError(f"{path} is not a {kind} file (written by {writer}).")
    return data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
