"""Cut a batch of whole sequences into one rank's shard along the sequence (the strategies'
``batch_to_device``). Labels come shifted by the data pipeline: a shard's labels belong to its
own positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from longnet.attention import DilatedPattern, fits_shards, padded_length
from longnet.constants import IGNORE_INDEX
from longnet.distributed.layouts import check_layout, shard_positions, stripe_count
from longnet.modeling.model import document_labels
from longnet.nn import document_position_ids
from longnet.validation import UsageError

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "document_ids", "label_bytes")


def pad_sequences(
    batch: Mapping[str, Any], length: int, pad_token_id: int
) -> dict[str, Any]:
    """Right-pad ``input_ids`` (``pad_token_id``), ``labels`` (-100), ``label_bytes`` (0),
    ``position_ids`` (counting on) and ``document_ids`` (the last document) to ``length``
    tokens; exact for a causal LM."""
    out = dict(batch)
    seq_len = batch["input_ids"].shape[-1]
    extra = length - seq_len
    if extra < 0:
        raise ValueError(f"cannot pad a sequence of {seq_len} tokens to {length}.")
    if extra == 0:
        return out
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "label_bytes": 0}
    for key, fill in fills.items():
        if key in batch:
            tensor: Tensor = batch[key]
            pad = tensor.new_full((*tensor.shape[:-1], extra), fill)
            out[key] = torch.cat((tensor, pad), dim=-1)
    if "position_ids" in batch:
        positions: Tensor = batch["position_ids"]
        tail = positions[..., -1:] + torch.arange(1, extra + 1, device=positions.device)
        out["position_ids"] = torch.cat((positions, tail), dim=-1)
    if "document_ids" in batch:
        ids: Tensor = batch["document_ids"]
        out["document_ids"] = torch.cat((ids, ids[..., -1:].expand(*ids.shape[:-1], extra)),
                                        dim=-1)
    return out


def shard_batch(
    batch: Mapping[str, Any],
    rank: int,
    world_size: int,
    *,
    pattern: DilatedPattern | None = None,
    pad_token_id: int = 0,
    layout: str = "contiguous",
) -> dict[str, Any]:
    """This rank's shard of every sequence of ``batch``.

    Args:
        batch: ``{"input_ids": (batch, seq), "labels", "position_ids": (seq,) or (batch,
            seq), "document_ids": (batch, seq), ...}`` (all but ``input_ids`` optional; other
            keys pass through). With ``document_ids`` (contiguous layout only) labels that
            cross a document and default positions are decided on the whole sequence first.
        rank, world_size: this rank's place in the sequence-parallel group and its size.
        pattern: the model's dilated pattern: the sequence is right-padded to
            ``padded_length(seq, pattern, stripes)``; without one, ``seq`` must be a multiple
            of ``stripes`` (``world_size``, twice that with ``zigzag``).
        pad_token_id: input id of padded positions.
        layout: ``"contiguous"`` or ``"zigzag"`` (``longnet.distributed.layouts``).

    Returns:
        The batch with ``input_ids``/``labels`` ``(batch, seq_padded / world_size)`` and
        ``position_ids`` the shard's global positions, ``(shard,)`` (``(batch, shard)``,
        per document, with ``document_ids``).
    """
    if "input_ids" not in batch:
        raise KeyError(
            f"sequence parallelism needs batches with an 'input_ids' entry; got keys "
            f"{sorted(batch)}."
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} ranks.")
    check_layout(layout, "shard_batch")
    input_ids: Tensor = batch["input_ids"]
    seq_len = input_ids.shape[-1]
    stripes = stripe_count(world_size, layout)
    if pattern is not None:
        length = padded_length(seq_len, pattern, stripes)
    elif seq_len % stripes:
        raise ValueError(
            f"sequence length {seq_len} does not cut into the {stripes} equal stripes of the "
            f"{layout} layout over {world_size} ranks; pick a seq_len that is a multiple of "
            f"{stripes} or let the LightningModule expose its dilated `pattern` so sequences "
            "are padded."
        )
    else:
        length = seq_len
    documents = batch.get("document_ids")
    if documents is not None and layout != "contiguous":
        raise UsageError(
            f"packed documents (document_ids) run on contiguous shards only, not {layout!r}; "
            "set load_balance: false on the sequence-parallel strategy."
        )
    out = dict(batch)
    if "position_ids" not in out and documents is None:
        out["position_ids"] = torch.arange(seq_len, device=input_ids.device)
    out = pad_sequences(out, length, pad_token_id)
    if documents is not None:
        if "labels" in out:
            out["labels"] = document_labels(out["labels"], out["document_ids"])
        if "position_ids" not in out:
            out["position_ids"] = document_position_ids(out["document_ids"])
    keep = shard_positions(length, rank, world_size, layout, input_ids.device)
    for key in SEQUENCE_KEYS:
        if key in out:
            out[key] = out[key].index_select(-1, keep)
    return out


def check_window_shards(
    seq_len: int, pattern: DilatedPattern | None, world_size: int, layout: str = "contiguous"
) -> None:
    """Refuse training windows of ``seq_len`` tokens that ``world_size`` ranks could run
    ``pattern`` on only after padding (:func:`longnet.attention.padded_length`): a
    :class:`~longnet.validation.UsageError` naming the nearest lengths that need none."""
    if world_size == 1:
        return
    stripes = stripe_count(world_size, layout)
    unit = "sequence shards" if layout == "contiguous" else f"{layout} stripes"
    if pattern is None:
        if seq_len % stripes:
            raise UsageError(
                f"seq_len {seq_len} cannot be cut into {stripes} equal {unit}; use a multiple "
                f"of {stripes}, e.g. {seq_len - seq_len % stripes}."
            )
        return
    if fits_shards(seq_len, pattern, stripes):
        return
    padded = padded_length(seq_len, pattern, stripes)
    shorter = next(
        (length for length in range(seq_len - seq_len % stripes, 0, -stripes)
         if fits_shards(length, pattern, stripes)),
        None,
    )
    options = " or ".join(str(length) for length in (shorter, padded) if length is not None)
    raise UsageError(
        f"seq_len {seq_len} cannot be cut into {stripes} {unit} that the pattern "
        f"{list(pattern.branches)} runs on: each branch's segment (capped at the window) must "
        f"divide the stripe or be a multiple of it, so every window would be padded to {padded} "
        f"tokens ({padded - seq_len} computed for nothing). Use seq_len {options}."
    )
