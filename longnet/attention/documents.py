"""Packed documents (docs/architecture.md §2 and §4): runs of equal ``document_ids``, each
attended as if alone. Checks the ids, turns them into lengths (:data:`Documents`, once for many
calls: :class:`PackedDocuments`) and lays one device's documents out for the plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.blocks import BlockGroup, Blocks, BlockStack, branch_groups, group_batch
from longnet.attention.pattern import DilatedPattern
from longnet.compiled import host_read

Documents = tuple[tuple[int, ...], ...]
"""The document lengths of each batch element, in sequence order (each sums to ``seq``)."""


def check_document_ids(
    document_ids: Tensor, batch: int, seq_len: int, device: torch.device,
    caller: str = "dilated_attention", of: str = "q",
) -> Tensor:
    """Check ``document_ids`` for the input ``of`` ``(batch, seq_len)`` on ``device``
    (messages name ``caller`` and ``of``); returns them on the host as int64.

    Raises:
        TypeError: ``document_ids`` is not an integer tensor.
        ValueError: a wrong shape or device, or ids that decrease somewhere.
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


def run_lengths(ids: Tensor) -> Documents:
    """The lengths of the runs of equal ids of every row of checked host ids ``(batch, seq)``."""
    return tuple(
        tuple(torch.unique_consecutive(row, return_counts=True)[1].tolist()) for row in ids
    )


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """Packed documents resolved once for many calls (:func:`resolve_documents`): ``ids``
    ``(batch, seq)`` on the device (this rank's shard) and every batch element's ``lengths``
    over the whole sequence."""

    ids: Tensor
    lengths: Documents

    def lengths_for(self, shape: torch.Size, world_size: int) -> Documents:
        """``lengths``, checked against this rank's ``q`` of ``shape`` ``(batch, seq, ...)``.

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
    """``document_ids`` ``(batch, seq_len)`` checked (:func:`check_document_ids`) with their
    lengths; with a ``process_group`` of several ranks they are this rank's contiguous shard,
    all-gathered for the whole sequence's lengths (docs/architecture.md §4)."""
    ids = check_document_ids(document_ids, batch, seq_len, device, caller, of)
    if process_group is not None and dist.get_world_size(process_group) > 1:
        shard = document_ids.long().contiguous()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(parts, shard, group=process_group)
        whole = torch.cat(parts, dim=1)
        ids = check_document_ids(whole, batch, whole.shape[1], device, caller, of)  # across shards
    return PackedDocuments(document_ids, run_lengths(ids))


def placed_documents(documents: Documents) -> list[tuple[int | None, tuple[int, ...]]]:
    """``(batch element, lengths)`` to lay out: ``[(None, lengths)]`` when all are equal."""
    if len(set(documents)) == 1:
        return [(None, documents[0])]
    return list(enumerate(documents))


def document_segments(lengths: Sequence[int], segment_length: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of every ``segment_length`` segment of every document, in order."""
    start = 0
    for length in lengths:
        for first in range(start, start + length, segment_length):
            yield first, min(first + segment_length, start + length)
        start += length


def document_branches(
    pattern: DilatedPattern, documents: Documents, num_heads: int
) -> list[list[BlockGroup]]:
    """The block groups of every branch over the documents of one device."""
    branches = []
    for w, r in pattern.branches:
        groups = []
        for element, lengths in placed_documents(documents):
            start = 0
            for length in lengths:
                groups += [
                    replace(group, start=start + group.start, batch=element)
                    for group in branch_groups(length, num_heads, w, r)
                ]
                start += length
        branches.append(groups)
    return branches


def stacked_chunks(
    groups: Sequence[BlockGroup], batch: int, head_dim: int, block_elements: int
) -> Iterator[Blocks]:
    """One branch's groups as kernel calls: chunks of at most ``block_elements`` elements,
    those of one block shape stacked (``BlockStack``) within the budget."""
    by_shape: dict[tuple[int, int], list[BlockGroup]] = {}
    for group in groups:
        row_elements = group_batch(group, batch) * head_dim
        for chunk in group.chunks(block_elements, row_elements):
            by_shape.setdefault((len(chunk.heads), chunk.rows), []).append(chunk)
    for (heads, rows), chunks in by_shape.items():
        stack: list[BlockGroup] = []
        elements = 0
        for chunk in chunks:
            size = group_batch(chunk, batch) * chunk.num_segments * heads * rows * head_dim
            if stack and elements + size > block_elements:
                yield _as_blocks(stack)
                stack, elements = [], 0
            stack.append(chunk)
            elements += size
        yield _as_blocks(stack)


def _as_blocks(chunks: list[BlockGroup]) -> Blocks:
    return chunks[0] if len(chunks) == 1 else BlockStack(tuple(chunks))
