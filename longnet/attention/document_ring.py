"""Packed documents under sequence parallelism (docs/architecture.md §4, "Packed documents
across ranks").

With a process group of ``P`` ranks holding contiguous shards of ``L`` tokens, each rank passes
its shard of ``document_ids``. The ranks first agree on the whole sequence's documents (one
all-gather of the ids). Then, for every branch ``(w, r)``, document and segment (a document's
segments start at its first token; the last one may be shorter):

* a segment inside one shard is a block group of the rank holding it, computed locally;
* a segment crossing shard boundaries is a spanning piece of the ring (``ring.SpanningPiece``)
  whose members are the ranks it touches, each holding the part of the segment inside its
  shard: its selected rows keep the dilation offsets of the whole segment (``shift``), so the
  exchange, the causal schedule and the merge are those of the ring.

Every rank derives the same global list and runs the pieces it is a member of in that order,
so two ranks sharing several pieces meet in each at the same time. A rank is a member of at
most two spanning segments per branch and document run (one entering its shard, one leaving
it); memory stays that of the ring: one message of a piece's selected rows at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.documents import Documents, check_document_ids, run_lengths
from longnet.attention.layout import BlockGroup, region_groups
from longnet.attention.pattern import DilatedPattern
from longnet.attention.ring import SpanningPiece, query_groups, ring_pieces


def global_documents(document_ids: Tensor, shard_shape: torch.Size, device: torch.device,
                     process_group: dist.ProcessGroup) -> Documents:
    """The document lengths of the whole sequence of every batch element, from this rank's
    shard of ``document_ids`` ``(batch, shard)`` (checked against ``q`` of ``shard_shape`` on
    ``device``): one all-gather of the ids on that device, one transfer to the host."""
    batch, shard_len = shard_shape[0], shard_shape[1]
    check_document_ids(document_ids, batch, shard_len, device)
    ids = document_ids.long().contiguous()
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(parts, ids, group=process_group)
    whole = torch.cat(parts, dim=1)
    return run_lengths(check_document_ids(whole, batch, whole.shape[1], device))  # across shards


def document_segments(lengths: Sequence[int], segment_length: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of every segment of every document of ``lengths`` (in sequence
    order), segments of ``segment_length`` tokens counted from each document's first token."""
    start = 0
    for length in lengths:
        for first in range(start, start + length, segment_length):
            yield first, min(first + segment_length, start + length)
        start += length


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
    docstring). Batch elements with the same documents share their groups."""
    shared = len(set(documents)) == 1
    placed = [(None, documents[0])] if shared else list(enumerate(documents))
    row_elements = (len(documents) if shared else 1) * head_dim
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
                index = rank - first
                for heads, groups in ring_pieces(member_groups, num_heads, row_elements,
                                                 block_elements):
                    label = (f"branch w={w} r={r} heads {heads[0]}-{heads[-1]}, document "
                             f"segment {start}-{stop}")
                    sets.append((SpanningPiece(members, index, groups, transport, label, heads,
                                               query_groups(groups[index], groups), members),))
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
