"""Packed documents as ``dilated_attention`` takes them: ``document_ids`` ``(batch, seq)``
mark runs of equal ids as documents (docs/architecture.md §2). This module checks the ids and
turns them into document lengths (:data:`~longnet.attention.plan.Documents`), on one device or
agreed across the ranks of a process group, per call or once for many calls
(:class:`PackedDocuments`); the plan (``plan.packed``) lays the documents out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.plan import Documents
from longnet.compiled import host_read


def check_document_ids(
    document_ids: Tensor, batch: int, seq_len: int, device: torch.device,
    caller: str = "dilated_attention", of: str = "q",
) -> Tensor:
    """Check ``document_ids`` for an input ``of`` (named in messages, as is ``caller``) of
    ``batch`` rows of ``seq_len`` tokens on ``device``; returns the ids on the host as int64
    (one transfer).

    Raises:
        TypeError: ``document_ids`` is not an integer tensor.
        ValueError: its shape is not ``(batch, seq)``, it lies on another device, or its ids
            decrease somewhere (the message names the first place).
    """
    if not isinstance(document_ids, Tensor):
        raise TypeError(
            f"{caller}: document_ids must be an integer torch.Tensor (batch, seq), got "
            f"{type(document_ids).__name__}."
        )
    if document_ids.is_floating_point() or document_ids.is_complex() \
            or document_ids.dtype == torch.bool:
        raise TypeError(
            f"{caller}: document_ids has dtype {document_ids.dtype}; use an integer dtype "
            "(torch.long)."
        )
    if tuple(document_ids.shape) != (batch, seq_len):
        raise ValueError(
            f"{caller}: document_ids has shape {tuple(document_ids.shape)}, expected "
            f"(batch, seq) = ({batch}, {seq_len}) of {of}; give one id per token."
        )
    if document_ids.device != device:
        raise ValueError(
            f"{caller}: document_ids is on {document_ids.device} but {of} on {device}; move it "
            f"to {of}'s device."
        )
    host_read(f"{caller}: document_ids given as a tensor are read on the host, which a "
              "torch.compile(fullgraph=True) region cannot hold; resolve them beforehand, "
              "outside it (longnet.attention.documents.resolve_documents, or call the "
              "model: LongNetModel resolves them once per forward) and pass the result.")
    ids = document_ids.detach().cpu().long()
    decreasing = (ids[:, 1:] < ids[:, :-1]).nonzero()
    if len(decreasing):
        b, t = decreasing[0].tolist()
        raise ValueError(
            f"{caller}: document_ids must not decrease along the sequence, but batch element "
            f"{b} goes from {int(ids[b, t])} at position {t} to {int(ids[b, t + 1])} at {t + 1}; "
            "number each batch element's documents in sequence order."
        )
    return ids


def document_lengths(document_ids: Tensor, shape: torch.Size, device: torch.device) -> Documents:
    """The lengths of the documents of ``document_ids``, checked (``check_document_ids``)
    against ``q`` of ``shape`` ``(batch, seq, heads, head_dim)`` on ``device``."""
    return run_lengths(check_document_ids(document_ids, shape[0], shape[1], device))


def run_lengths(ids: Tensor) -> Documents:
    """The lengths of the runs of equal ids of every row of checked host ids ``(batch, seq)``."""
    return tuple(
        tuple(torch.unique_consecutive(row, return_counts=True)[1].tolist()) for row in ids
    )


def global_documents(document_ids: Tensor, shard_shape: tuple[int, ...], device: torch.device,
                     process_group: dist.ProcessGroup) -> Documents:
    """The document lengths of the whole sequence of every batch element, from this rank's
    contiguous shard of ``document_ids`` ``(batch, shard)`` (checked against ``q`` of
    ``shard_shape`` on ``device``): one all-gather of the ids on that device, one transfer to
    the host (docs/architecture.md §4, "Packed documents across ranks")."""
    batch, shard_len = shard_shape[0], shard_shape[1]
    check_document_ids(document_ids, batch, shard_len, device)
    ids = document_ids.long().contiguous()
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(parts, ids, group=process_group)
    whole = torch.cat(parts, dim=1)
    return run_lengths(check_document_ids(whole, batch, whole.shape[1], device))  # across shards


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """Packed documents resolved once for many attention calls (a model's layers).

    ``ids``: ``(batch, seq)`` document ids on the device (this rank's shard under sequence
    parallelism), for what the layers compute from them (positions in each document, the K/V
    convolution's boundaries); ``lengths``: every batch element's document lengths over the
    whole sequence (all ranks' shards), for the attention plan. Make it with
    :func:`resolve_documents`.
    """

    ids: Tensor
    lengths: Documents

    def lengths_for(self, shape: torch.Size, world_size: int) -> Documents:
        """``lengths``, checked against ``q`` of ``shape`` ``(batch, seq, heads, head_dim)``,
        this rank's shard of ``world_size`` (without a transfer to the host).

        Raises:
            ValueError: the documents were resolved for another batch or sequence length.
        """
        batch, seq_len = shape[0], shape[1]
        total = seq_len * world_size
        if tuple(self.ids.shape) != (batch, seq_len) or len(self.lengths) != batch or any(
            sum(row) != total for row in self.lengths
        ):
            raise ValueError(
                f"dilated_attention: the PackedDocuments were resolved for ids of shape "
                f"{tuple(self.ids.shape)} ({[sum(row) for row in self.lengths]} tokens per "
                f"batch element), but q has (batch, seq) = ({batch}, {seq_len}) "
                f"({total} tokens per batch element over {world_size} rank(s)); resolve the "
                "document ids of this input with resolve_documents."
            )
        return self.lengths


def resolve_documents(
    document_ids: Tensor, batch: int, seq_len: int, device: torch.device,
    process_group: dist.ProcessGroup | None = None, caller: str = "dilated_attention",
    of: str = "q",
) -> PackedDocuments:
    """``document_ids`` ``(batch, seq_len)`` on ``device`` (checked as
    :func:`check_document_ids` does, messages naming ``caller`` and ``of``) with their document
    lengths: one transfer of the ids to the host; with a ``process_group`` of several ranks,
    the ids are this rank's contiguous shard and the ranks agree on the lengths of the whole
    sequence with one all-gather (:func:`global_documents`)."""
    if process_group is None or dist.get_world_size(process_group) == 1:
        ids = check_document_ids(document_ids, batch, seq_len, device, caller, of)
        return PackedDocuments(document_ids, run_lengths(ids))
    return PackedDocuments(
        document_ids, global_documents(document_ids, (batch, seq_len), device, process_group)
    )
