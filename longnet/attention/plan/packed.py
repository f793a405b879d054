"""Geometry of packed documents, on one device and across ranks (docs/architecture.md §2 and
§4, "Packed documents").

Each document is attended as if it were alone: its branches' segments start at its first token
and no key of another document is seen. Documents of every batch element share their block
groups when every batch element holds the same document lengths, else each group covers one
batch element (``BlockGroup.batch``; :func:`placed_documents`).

* One device: per document, the block groups are ``branch_groups(length, ...)`` moved to the
  document's start; the groups of a branch that have one block shape (the full segments of
  every document, and tails of equal length) are stacked into one kernel call
  (``blocks.BlockStack``), up to the block budget (:func:`stacked_chunks`).
* Across ranks (contiguous shards of ``L`` tokens): a segment inside one shard is a block
  group of the rank holding it; a segment crossing shard boundaries is a spanning piece
  (``spanning.SpanningPiece``) whose members are the ranks it touches, each holding the part
  of the segment inside its shard, its rows keeping the dilation offsets of the whole segment.
  Every rank derives the same global list and runs the pieces it is a member of in that order,
  so two ranks sharing several pieces meet in each at the same time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from longnet.attention.blocks import (
    BlockGroup,
    Blocks,
    BlockStack,
    branch_groups,
    group_batch,
    region_groups,
)
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan.spanning import SpanningPiece, spanning_pieces

Documents = tuple[tuple[int, ...], ...]
"""The document lengths of each batch element, in sequence order (each sums to ``seq``)."""


def placed_documents(documents: Documents) -> list[tuple[int | None, tuple[int, ...]]]:
    """``(batch element, document lengths)`` to lay out: one entry for all batch elements
    (element None) when they hold the same documents, else one per batch element."""
    if len(set(documents)) == 1:
        return [(None, documents[0])]
    return list(enumerate(documents))


def document_segments(lengths: Sequence[int], segment_length: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of every segment of every document of ``lengths`` (in sequence
    order), segments of ``segment_length`` tokens counted from each document's first token."""
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


def plan_document_ring(
    pattern: DilatedPattern,
    documents: Documents,
    shard_len: int,
    rank: int,
    num_heads: int,
    transports: Sequence[str],
    head_dim: int,
    block_elements: int,
) -> tuple[list[list[BlockGroup]], list[tuple[SpanningPiece, ...]]]:
    """This rank's local block groups per branch (shard coordinates) and the spanning pieces
    it is a member of, each as a one-member set, in the global order (see the module
    docstring); contiguous shards of ``shard_len`` tokens, so members are group ranks."""
    placed = placed_documents(documents)
    row_elements = (len(documents) if placed[0][0] is None else 1) * head_dim
    local: list[list[BlockGroup]] = [[] for _ in pattern.branches]
    sets: list[tuple[SpanningPiece, ...]] = []
    here = (rank * shard_len, (rank + 1) * shard_len)
    for branch, ((w, r), transport) in enumerate(zip(pattern.branches, transports)):
        for element, lengths in placed:
            for start, stop in document_segments(lengths, w):
                first, last = start // shard_len, (stop - 1) // shard_len
                if not first <= rank <= last:
                    continue
                if first == last:
                    local[branch] += _part(start, stop, here, num_heads, r, element)
                    continue
                members = tuple(range(first, last + 1))
                member_groups = tuple(
                    tuple(_part(start, stop, (m * shard_len, (m + 1) * shard_len), num_heads,
                                r, element))
                    for m in members
                )
                label = f"branch w={w} r={r} document segment {start}-{stop}"
                sets += [(piece,) for piece in spanning_pieces(
                    members, rank - first, member_groups, transport, label, num_heads,
                    row_elements, block_elements, members,
                )]
    return local, sets


def _part(start: int, stop: int, shard: tuple[int, int], num_heads: int, rate: int,
          element: int | None) -> list[BlockGroup]:
    """The block groups of the part of segment ``[start, stop)`` inside ``shard`` (global
    ``[first, end)``), in shard coordinates, for batch element ``element`` (None: all); heads
    keep the segment's dilation offsets (``shift``)."""
    first, end = max(start, shard[0]), min(stop, shard[1])
    return [replace(group, batch=element)
            for group in region_groups(first - shard[0], end - first, 1, num_heads, rate,
                                       shift=first - start)]
