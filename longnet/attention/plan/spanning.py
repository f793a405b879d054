"""Geometry of the branches whose segments span ranks (docs/architecture.md §4). Each rank
holds one stripe (``contiguous``) or two (``zigzag``). A branch whose segment divides the stripe
is local; one whose segment is a multiple of it spans a segment group of stripes (its members),
whose dilated K/V rows travel as :class:`SpanningPiece` s (``ring.py``). Every rank derives
every member's rows (dilation offsets may drift between members) from the global geometry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from longnet.attention.blocks import BlockGroup, branch_groups, region_groups, restrict
from longnet.attention.documents import Documents, document_segments, placed_documents
from longnet.attention.pattern import DilatedPattern
from longnet.distributed.layouts import rank_stripes, stripe_count, stripe_host, stripes_per_rank


@dataclass(frozen=True)
class SpanningPiece:
    """A few ``heads`` of a branch spanning ranks (one message within the block budget), seen
    from member ``index`` of ``members`` (the segment group's stripes, in sequence order):
    ``member_groups[m]``, the rows member ``m`` selects for ``heads`` (shard coordinates);
    ``query_groups``: this member's groups split so each one's heads lie in one group of every
    member; ``hosts[m]``: the group rank holding member ``m``; ``stripe``: the ``(start, stop)``
    rows of the shard this member is (None: all). Tensors are ``(batch, shard, heads, dim)``.
    """

    members: tuple[int, ...]
    index: int
    member_groups: tuple[tuple[BlockGroup, ...], ...]
    transport: str
    label: str
    heads: tuple[int, ...]
    query_groups: tuple[BlockGroup, ...]
    hosts: tuple[int, ...]
    stripe: tuple[int, int] | None = None

    def rows(self, x: Tensor) -> Tensor:
        """This member's rows of a shard tensor ``(batch, shard, ...)`` (a view)."""
        return x if self.stripe is None else x[:, self.stripe[0] : self.stripe[1]]

    @property
    def rows_max(self) -> int:
        """The message's row dimension: the most rows any member selects for one head."""
        return max(group.rows for groups in self.member_groups for group in groups)

    @property
    def message_batch(self) -> int | None:
        """The message's batch dimension: 1 for one batch element, else None (all)."""
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
    """Rank ``rank``'s local branches (block groups over its shard) and the spanning pieces,
    in sets run together: this rank's members of one piece, one per stripe it holds;
    ``row_elements`` = batch * head_dim and ``block_elements`` size the pieces."""
    per_rank = stripes_per_rank(layout)
    if shard_len % per_rank:
        raise ValueError(
            f"dilated_attention: the zigzag layout cuts each shard into two equal stripes, but "
            f"the shard has {shard_len} tokens (odd). Pad the sequence to "
            f"longnet.attention.padded_length(N, pattern, {2 * world_size}) tokens."
        )
    stripe_len = shard_len // per_rank
    stripes = stripe_count(world_size, layout)
    seq_len = stripe_len * stripes
    local: list[list[BlockGroup]] = []
    sets: list[tuple[SpanningPiece, ...]] = []
    for (w, r), transport in zip(pattern.branches, transports):
        segment = min(w, seq_len)
        if not branch_fits(segment, stripe_len):
            unit = "zigzag stripe length" if per_rank == 2 else "shard length"
            raise ValueError(
                f"dilated_attention: branch (w={w}, r={r}) cannot be split over {world_size} "
                f"ranks: its segment length {segment} neither divides nor is a multiple of the "
                f"{unit} {stripe_len}. Pad the sequence to longnet.attention.padded_length("
                f"{seq_len}, pattern, {stripes}) = {padded_length(seq_len, pattern, stripes)} "
                "tokens, or change the pattern."
            )
        if segment <= stripe_len:  # a stripe holds whole segments: so does a zigzag shard
            local.append(branch_groups(shard_len, num_heads, segment, r))
            continue
        per_member = []
        for slot, member in enumerate(rank_stripes(rank, world_size, layout)):
            start, members = segment_group(member, stripe_len, segment, seq_len)
            hosts = tuple(stripe_host(m, world_size, layout) for m in members)
            rows = None if per_rank == 1 else (slot * stripe_len, (slot + 1) * stripe_len)
            member_groups = tuple(
                tuple(region_groups(0, stripe_len, 1, num_heads, r, shift=m * stripe_len - start))
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
    stripe: tuple[int, int] | None = None,
) -> list[SpanningPiece]:
    """The pieces of one segment group seen from member ``index`` (``ring_pieces``)."""
    return [
        SpanningPiece(members, index, groups, transport,
                      f"{label} heads {heads[0]}-{heads[-1]}", heads,
                      query_groups(groups[index], groups), hosts, stripe)
        for heads, groups in ring_pieces(member_groups, num_heads, row_elements, block_elements)
    ]


def segment_group(
    member: int, stripe_len: int, segment: int, seq_len: int
) -> tuple[int, tuple[int, ...]]:
    """The first token of ``member``'s ``segment`` and its stripes (the last cut at ``seq_len``)."""
    start = member * stripe_len // segment * segment
    return start, tuple(range(start // stripe_len, min(start + segment, seq_len) // stripe_len))


def heads_per_piece(rows: int, row_elements: int, num_heads: int, block_elements: int) -> int:
    """Heads per piece such that one message (K and V, ``rows`` rows of ``row_elements``
    per head) holds at most ``block_elements`` elements; at least one."""
    return min(num_heads, max(1, block_elements // (2 * rows * row_elements)))


def ring_pieces(
    member_groups: Sequence[Sequence[BlockGroup]], num_heads: int, row_elements: int,
    block_elements: int,
) -> list[tuple[tuple[int, ...], tuple[tuple[BlockGroup, ...], ...]]]:
    """A spanning branch split by heads: ``(heads, member groups)`` per piece, alike on all."""
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
    """``own`` split so that the heads of each part lie in one group of every member."""
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
    """This rank's local block groups per branch and its spanning pieces for packed
    ``documents`` on contiguous shards: a document segment crossing shards is a piece whose
    members are the ranks it touches. Every rank runs its pieces in the one global order
    (one-member sets), so ranks sharing several pieces meet in each at the same time."""
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
    """The block groups (shard coordinates) of segment ``[start, stop)``'s part in ``shard``,
    keeping the segment's dilation offsets, for batch element ``element`` (None: all)."""
    first, end = max(start, shard[0]), min(stop, shard[1])
    return [replace(group, batch=element)
            for group in region_groups(first - shard[0], end - first, 1, num_heads, rate,
                                       shift=first - start)]


def branch_fits(segment_length: int, shard_len: int) -> bool:
    """Whether a branch runs on shards of ``shard_len`` tokens: one length divides the other."""
    return shard_len % segment_length == 0 or segment_length % shard_len == 0


def fits_shards(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> bool:
    """Whether ``world_size`` ranks run ``pattern`` on ``seq_len`` tokens as they are: equal
    shards, which every branch (its segment capped at ``seq_len``) fits (:func:`branch_fits`)."""
    if seq_len % world_size:
        return False
    shard_len = seq_len // world_size
    pattern = DilatedPattern.coerce(pattern)
    return all(branch_fits(min(w, seq_len), shard_len) for w in pattern.segment_lengths)


def padded_length(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> int:
    """The smallest length ``>= seq_len`` that ``world_size`` ranks can run ``pattern`` on;
    end padding is exact for causal attention (bidirectional: pad tokens are keys)."""
    pattern = DilatedPattern.coerce(pattern)
    if seq_len < 1 or world_size < 1:
        raise ValueError(
            f"padded_length: need seq_len >= 1 and world_size >= 1, got {seq_len}, {world_size}."
        )
    shard_len = -(-seq_len // world_size)
    while (longer := _next_shard_len(shard_len, pattern.segment_lengths, world_size)) > shard_len:
        shard_len = longer
    return shard_len * world_size


def _next_shard_len(shard_len: int, segment_lengths: Sequence[int], world_size: int) -> int:
    """``shard_len`` if every branch fits it, else the next shard length not ruled out: a
    multiple of the lcm of the shorter segments, and a divisor of each longer one."""
    segments = [min(w, shard_len * world_size) for w in segment_lengths]
    step = math.lcm(*(w for w in segments if w <= shard_len))
    if shard_len % step:
        return shard_len + step - shard_len % step
    for w in segments:
        if w > shard_len and w % shard_len:  # q < w / shard_len <= world_size candidates
            return next(w // q for q in range((w - 1) // shard_len, 0, -1) if w % q == 0)
    return shard_len
