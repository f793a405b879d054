"""Geometry of the branches whose segments span ranks (docs/architecture.md §4).

A process group of ``P`` ranks holds shards of ``L = N / P`` tokens (``contiguous``), or of two
chunks of ``C = N / 2P`` tokens each (``zigzag``, ``longnet.distributed.layouts``). A branch
whose segment length ``w`` divides the chunk is local. A branch with ``w`` a multiple of it has
segments spanning ``g = w / C`` consecutive chunks (its segment group, whose members are the
chunks); only the dilated rows of K and V travel among their hosts, as
:class:`SpanningPiece` s of a few heads each (``ring.py`` runs them).

Dilation offsets may drift from member to member (when ``r`` does not divide the chunk): every
rank knows every member's selected rows from the global geometry, so this is handled exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longnet.attention.blocks import BlockGroup, branch_groups, region_groups, restrict
from longnet.attention.pattern import DilatedPattern
from longnet.attention.shard_lengths import branch_fits, padded_length
from longnet.distributed.layouts import chunk_count, chunk_host, chunks_per_rank, rank_chunks


@dataclass(frozen=True)
class SpanningPiece:
    """A piece of one branch whose segments span several ranks: its heads ``heads`` (a few, so
    that one message stays within the block budget), seen from one member; either transport.

    ``members``: the members (chunks) of this segment group in sequence order, ``index`` this
    member's place among them, ``member_groups[m]`` the rows member ``m`` selects for
    ``heads`` (shard coordinates; a few head groups when dilation offsets drift).
    ``query_groups``: this member's groups split so that each one's heads lie in one group of
    every member; its query-side rows are gathered once and meet every arriving block.
    ``hosts[m]``: the group rank holding member ``m``, and ``chunk`` the ``(start, stop)`` rows
    of this rank's shard that this member is (None: the whole shard).
    Tensors use the sequence layout ``(batch, shard, heads, dim)`` (``lse``: ``dim`` = 1).
    """

    members: tuple[int, ...]
    index: int
    member_groups: tuple[tuple[BlockGroup, ...], ...]
    transport: str
    label: str
    heads: tuple[int, ...]
    query_groups: tuple[BlockGroup, ...]
    hosts: tuple[int, ...]
    chunk: tuple[int, int] | None = None

    def rows(self, x: Tensor) -> Tensor:
        """This member's rows of a shard tensor ``(batch, shard, ...)`` (a view)."""
        return x if self.chunk is None else x[:, self.chunk[0] : self.chunk[1]]

    @property
    def rows_max(self) -> int:
        """The message's row dimension: the most rows any member selects for one head."""
        return max(group.rows for groups in self.member_groups for group in groups)

    @property
    def message_batch(self) -> int | None:
        """The message's batch dimension: 1 when the piece covers one batch element (packed
        documents), None for the whole batch."""
        element = next(group.batch for groups in self.member_groups for group in groups)
        return None if element is None else 1

    def positions(self, heads: Sequence[int], device: torch.device) -> slice | Tensor:
        """Where ``heads`` sit in the message's head dimension (a slice when consecutive)."""
        where = [self.heads.index(head) for head in heads]
        if where == list(range(where[0], where[0] + len(where))):
            return slice(where[0], where[0] + len(where))
        return torch.tensor(where, device=device)

    def key_rows(self, query_group: BlockGroup, source: int) -> int:
        """Rows of member ``source``'s block for the heads of ``query_group`` (0: none)."""
        head = query_group.heads[0]
        return next((g.rows for g in self.member_groups[source] if head in g.heads), 0)


def plan_sequence_parallel(
    pattern: DilatedPattern,
    shard_len: int,
    world_size: int,
    rank: int,
    num_heads: int,
    transports: Sequence[str],
    row_elements: int,
    block_elements: int,
    layout: str = "contiguous",
) -> tuple[list[list[BlockGroup]], list[tuple[SpanningPiece, ...]]]:
    """Split ``pattern`` into local branches (their block groups over this rank's shard) and
    the pieces of branches spanning ranks, for group rank ``rank``; ``row_elements`` = batch *
    head_dim and ``block_elements`` size the pieces (see ``heads_per_piece``).

    Pieces come in sets run together (``ring.py``): this rank's members of one piece, one per
    chunk it holds (``shards.rank_chunks``: one with ``contiguous``, two with ``zigzag``, which
    may share a segment group)."""
    per_rank = chunks_per_rank(layout)
    if shard_len % per_rank:
        raise ValueError(
            f"dilated_attention: the zigzag layout cuts each shard into two equal chunks, but "
            f"the shard has {shard_len} tokens (odd). Pad the sequence to "
            f"longnet.attention.padded_length(N, pattern, {2 * world_size}) tokens."
        )
    chunk_len = shard_len // per_rank
    chunks = chunk_count(world_size, layout)
    seq_len = chunk_len * chunks
    local: list[list[BlockGroup]] = []
    sets: list[tuple[SpanningPiece, ...]] = []
    for (w, r), transport in zip(pattern.branches, transports):
        segment = min(w, seq_len)
        if not branch_fits(segment, chunk_len):
            unit = "zigzag chunk length" if per_rank == 2 else "shard length"
            raise ValueError(
                f"dilated_attention: branch (w={w}, r={r}) cannot be split over {world_size} "
                f"ranks: its segment length {segment} neither divides nor is a multiple of the "
                f"{unit} {chunk_len}. Pad the sequence to longnet.attention.padded_length("
                f"{seq_len}, pattern, {chunks}) = {padded_length(seq_len, pattern, chunks)} "
                "tokens, or change the pattern."
            )
        if segment <= chunk_len:  # a chunk holds whole segments: so does a zigzag shard
            local.append(branch_groups(shard_len, num_heads, segment, r))
            continue
        if per_rank == 2 and transport != "ring":
            raise ValueError(
                f"dilated_attention: the zigzag layout runs the ring transport only; branch "
                f"(w={w}, r={r}) asks for {transport!r}. Use transport='ring'."
            )
        per_member = []
        for slot, member in enumerate(rank_chunks(rank, world_size, layout)):
            start, members = segment_group(member, chunk_len, segment, seq_len)
            hosts = tuple(chunk_host(m, world_size, layout) for m in members)
            rows = None if per_rank == 1 else (slot * chunk_len, (slot + 1) * chunk_len)
            member_groups = tuple(
                tuple(region_groups(0, chunk_len, 1, num_heads, r, shift=m * chunk_len - start))
                for m in members
            )
            per_member.append(spanning_pieces(
                members, member - members[0], member_groups, transport, f"branch w={w} r={r}",
                num_heads, row_elements, block_elements, hosts, rows,
            ))
        sets += list(zip(*per_member))
    return local, sets


def spanning_pieces(
    members: tuple[int, ...],
    index: int,
    member_groups: tuple[tuple[BlockGroup, ...], ...],
    transport: str,
    label: str,
    num_heads: int,
    row_elements: int,
    block_elements: int,
    hosts: tuple[int, ...],
    chunk: tuple[int, int] | None = None,
) -> list[SpanningPiece]:
    """The pieces of one segment group seen from member ``index`` (``ring_pieces``), labelled
    ``label`` and their heads."""
    return [
        SpanningPiece(members, index, groups, transport,
                      f"{label} heads {heads[0]}-{heads[-1]}", heads,
                      query_groups(groups[index], groups), hosts, chunk)
        for heads, groups in ring_pieces(member_groups, num_heads, row_elements, block_elements)
    ]


def segment_group(
    member: int, chunk_len: int, segment: int, seq_len: int
) -> tuple[int, tuple[int, ...]]:
    """``(start, members)`` for a branch whose ``segment`` (a multiple of ``chunk_len``) spans
    chunks: the first token of ``member``'s segment and the chunks holding it, in sequence
    order (the last segment may be cut at ``seq_len``)."""
    start = member * chunk_len // segment * segment
    return start, tuple(range(start // chunk_len, min(start + segment, seq_len) // chunk_len))


def heads_per_piece(rows: int, row_elements: int, num_heads: int, block_elements: int) -> int:
    """Heads per piece of a spanning branch whose members select at most ``rows`` rows per
    head: one message (K and V rows of a piece's heads, ``row_elements`` = batch * head_dim per
    row) holds at most ``block_elements`` elements, and at least one head."""
    return min(num_heads, max(1, block_elements // (2 * rows * row_elements)))


def ring_pieces(
    member_groups: Sequence[Sequence[BlockGroup]], num_heads: int, row_elements: int,
    block_elements: int,
) -> list[tuple[tuple[int, ...], tuple[tuple[BlockGroup, ...], ...]]]:
    """Split a branch spanning ranks (either transport) by heads (``heads_per_piece``):
    ``(heads, member groups)`` per piece. Every member of a segment group computes the same
    pieces (same global geometry)."""
    rows = max(group.rows for groups in member_groups for group in groups)
    per_piece = heads_per_piece(rows, row_elements, num_heads, block_elements)
    pieces = []
    for first in range(0, num_heads, per_piece):
        heads = tuple(range(first, min(first + per_piece, num_heads)))
        groups = tuple(
            tuple(restrict(group, heads) for group in groups if set(group.heads) & set(heads))
            for groups in member_groups
        )
        if any(groups):
            pieces.append((heads, groups))
    return pieces


def query_groups(
    own: Sequence[BlockGroup], member_groups: Sequence[Sequence[BlockGroup]]
) -> tuple[BlockGroup, ...]:
    """``own`` split so that the heads of each part lie in one group of every member (with
    drifting offsets a head's row count differs from member to member)."""
    parts = []
    for group in own:
        by_keys: dict[tuple[int, ...], list[int]] = {}
        for head in group.heads:
            key = tuple(
                next((i for i, g in enumerate(groups) if head in g.heads), -1)
                for groups in member_groups
            )
            by_keys.setdefault(key, []).append(head)
        parts += [restrict(group, heads) for heads in by_keys.values()]
    return tuple(parts)
