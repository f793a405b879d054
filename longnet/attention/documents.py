"""Packed documents: dilated attention inside each document of a batch (docs/architecture.md §2).

``document_ids`` ``(batch, seq)`` mark runs of equal ids as documents. Each document is
attended as if it were alone: its branches' segments start at its first token and no key of
another document is seen. Per document, the block groups are ``branch_groups(length, ...)``
moved to the document's start; documents of every batch element share the groups when every
batch element holds the same document lengths, else each group covers one batch element
(``BlockGroup.batch``). The groups of a branch that have one block shape (as many heads, as
many rows: the full segments of every document, and tails of equal length) are stacked into
one kernel call (``layout.BlockStack``), up to the block budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from longnet.attention.layout import BlockGroup, Blocks, BlockStack, branch_groups, group_batch
from longnet.attention.pattern import DilatedPattern

Documents = tuple[tuple[int, ...], ...]
"""The document lengths of each batch element, in sequence order (each sums to ``seq``)."""


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


def document_branches(
    pattern: DilatedPattern, documents: Documents, num_heads: int
) -> list[list[BlockGroup]]:
    """The block groups of every branch over the documents (see the module docstring)."""
    shared = len(set(documents)) == 1
    placed = [(None, documents[0])] if shared else list(enumerate(documents))
    branches = []
    for w, r in pattern.branches:
        groups = []
        for batch, lengths in placed:
            start = 0
            for length in lengths:
                groups += [
                    replace(group, start=start + group.start, batch=batch)
                    for group in branch_groups(length, num_heads, w, r)
                ]
                start += length
        branches.append(groups)
    return branches


def stacked_chunks(
    groups: Sequence[BlockGroup], batch: int, head_dim: int, block_elements: int
) -> Iterator[Blocks]:
    """The groups of one branch as kernel calls: each group split into chunks of at most
    ``block_elements`` elements (``BlockGroup.chunks``), the chunks of one block shape
    stacked while the stack stays within the budget; a lone chunk is run as it is."""
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
