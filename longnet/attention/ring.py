"""Sequence parallelism: queries stay local, selected K/V rows travel (docs/architecture.md §4).

A process group of ``P`` ranks holds contiguous shards of ``L = N / P`` tokens. A branch whose
segment length ``w`` divides ``L`` is local (no communication; ``local.py`` runs it). A branch
with ``w`` a multiple of ``L`` has segments spanning ``g = w / L`` consecutive ranks (its
segment group); only the dilated rows of K and V travel, only among those ranks, as
:class:`SpanningPiece` s of a few heads each, moved by either transport (``transport.py``):

- ``ring``: the packed K/V block rotates around the sub-ring with one batched send/recv per
  hop; the next hop is posted before the current block is computed. In the backward, the dK/dV
  accumulator travels with its block and arrives home after the full loop.
- ``allgather``: every rank receives every block of its segment group at once; the backward
  sends each block's dK/dV partial sums straight to the block's owner.

Dilation offsets may drift from rank to rank (when ``r`` does not divide ``L``): every rank
knows every member's selected rows from the global geometry, so this is handled exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.layout import (
    BlockGroup,
    branch_groups,
    gather,
    region_groups,
    restrict,
    scatter_,
)
from longnet.attention.merge import BackwardQueries, QueryRows, lse_merge_
from longnet.attention.pattern import DilatedPattern
from longnet.attention.shard_lengths import branch_fits, padded_length
from longnet.attention.transport import Peers, Schedule
from longnet.distributed.shards import chunk_host

if TYPE_CHECKING:
    from longnet.attention.plan import AttentionPlan


Attend = Callable[[Tensor, int, Tensor | None], None]  # (kv block, source member, dK/dV or None)


class ForwardQueries(NamedTuple):
    """One query group of a piece in the forward: its accumulator rows and its queries."""

    rows: QueryRows
    q: Tensor


class BackwardEntry(NamedTuple):
    """One query group of a piece in the backward: what its queries need, and their dQ."""

    group: BlockGroup
    rows: BackwardQueries
    d_q: Tensor


@dataclass(frozen=True)
class SpanningPiece:
    """A piece of one branch whose segments span several ranks: its heads ``heads`` (a few, so
    that one message stays within the block budget), seen from one rank; either transport.

    ``members`` are the group ranks of this rank's segment group in sequence order, ``index``
    this rank's place among them, ``member_groups[m]`` the rows member ``m`` selects for
    ``heads`` (shard coordinates; a few head groups when dilation offsets drift).
    ``query_groups``: this rank's groups split so that each one's heads lie in one group of
    every member; its query-side rows are gathered once and meet every arriving block.
    ``hosts[m]``: the group rank holding member ``m``, and ``chunk`` the ``(start, stop)`` rows
    of this rank's shard that this member is (None: the whole shard; contiguous layout: the
    members are group ranks holding whole shards; zigzag: the ``2P`` chunks, two per rank).
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
        return max(group.rows for groups in self.member_groups for group in groups)

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

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """This rank's selected K and V rows of ``heads`` as one message
        ``(2, batch, len(heads), rows_max, dim)``."""
        element = next(group.batch for groups in self.member_groups for group in groups)
        batch = k.shape[0] if element is None else 1  # one batch element: packed documents
        packed = k.new_zeros(2, batch, len(self.heads), self.rows_max, k.shape[-1])
        for group in self.member_groups[self.index]:
            index = self.positions(group.heads, k.device)
            packed[0][:, index, : group.rows] = gather(k, group)
            packed[1][:, index, : group.rows] = gather(v, group)
        return packed

    def unpack_add_(self, d_k: Tensor, d_v: Tensor, packed: Tensor) -> None:
        """Add a ``pack``-shaped gradient of this rank's rows into ``d_k``/``d_v`` (in place)."""
        for group in self.member_groups[self.index]:
            index = self.positions(group.heads, d_k.device)
            scatter_(d_k, group, packed[0][:, index, : group.rows], accumulate=True)
            scatter_(d_v, group, packed[1][:, index, : group.rows], accumulate=True)

    def _key_blocks(
        self, kv: Tensor, source: int, query_groups: Sequence[BlockGroup]
    ) -> Iterator[tuple[int, slice | Tensor, Tensor, Tensor]]:
        """``(query group number, head index, k block, v block)`` for every query group that
        meets member ``source``'s block ``kv``; the head index places the group's heads in
        ``kv``'s head dimension."""
        for number, query_group in enumerate(query_groups):
            rows = self.key_rows(query_group, source)
            if rows:
                index = self.positions(query_group.heads, kv.device)
                yield number, index, kv[0][:, index, :rows], kv[1][:, index, :rows]

    def _allgather(self, peers: Peers, kv: Tensor, causal: bool, attend: Attend,
                   grad_dtype: torch.dtype | None) -> Tensor | None:
        """The ``allgather`` transport: every block of the segment group at once; in the
        backward (``grad_dtype`` set) each dK/dV partial goes straight to its block's owner and
        the sum for this rank's block is returned."""
        schedule = Schedule(len(self.members), self.index, causal)
        gathered = peers.all_gather(kv)
        partials: list[Tensor | None] = [None] * schedule.size
        for source in schedule.sources:
            if grad_dtype is not None:
                partials[source] = torch.zeros_like(kv, dtype=grad_dtype)
            attend(gathered[source], source, partials[source])
        return None if grad_dtype is None else peers.reduce_to_owners(partials, schedule)

    def prepare_forward(
        self, out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan
    ) -> Prepared:
        """This member's message and how it merges arriving blocks into ``out``/``lse``
        (sequence layout, in place, ``finish()`` at the end)."""
        out, lse, q, k, v = (self.rows(t) for t in (out, lse, q, k, v))
        forward, scale = plan.kernel.forward, plan.scale
        queries = [ForwardQueries(QueryRows.gather(out, lse, g), gather(q, g))
                   for g in self.query_groups]

        def attend(kv: Tensor, source: int, _: None) -> None:
            diagonal = plan.causal and source == self.index
            for number, _, k_b, v_b in self._key_blocks(kv, source, self.query_groups):
                rows, q_b = queries[number]
                block_out, block_lse = forward(q_b, k_b, v_b, diagonal, scale)
                lse_merge_(rows.out, rows.lse, block_out, block_lse)

        def finish(_: None) -> None:
            for rows, _ in queries:
                rows.write_back_(out, lse)

        return Prepared(self, self.pack(k, v), attend, finish)

    def prepare_backward(
        self,
        grads: Sequence[Tensor],
        d_out: Tensor,
        d_lse: Tensor | None,
        saved: Sequence[Tensor],
        plan: AttentionPlan,
    ) -> Prepared:
        """This member's message and how arriving blocks add into ``grads = (dq, dk, dv)``
        (sequence layout, in place; ``finish(own dK/dV)`` at the end); ``saved = (q, k, v, out,
        lse)``, the forward's inputs and global results."""
        q, k, v, out, lse = (self.rows(t) for t in saved)
        d_out = self.rows(d_out)
        d_lse = None if d_lse is None else self.rows(d_lse)
        grads = [self.rows(grad) for grad in grads]
        entries = []
        for group in self.query_groups:
            rows = BackwardQueries.gather(d_out, q, out, lse, d_lse, group)
            d_q = torch.zeros_like(rows.q, dtype=grads[0].dtype)
            entries.append(BackwardEntry(group, rows, d_q))

        def attend(kv: Tensor, source: int, d_kv: Tensor) -> None:
            diagonal = plan.causal and source == self.index
            for number, index, k_b, v_b in self._key_blocks(kv, source, self.query_groups):
                rows, d_q_b = entries[number].rows, entries[number].d_q
                d_q, d_k, d_v = plan.kernel.block_backward(
                    rows.block(k_b, v_b), rows.d_lse, diagonal, plan.scale
                )
                d_q_b += d_q
                key_rows = k_b.shape[-2]
                d_kv[0][:, index, :key_rows] += d_k
                d_kv[1][:, index, :key_rows] += d_v

        def finish(own: Tensor) -> None:
            self.unpack_add_(grads[1], grads[2], own)
            for entry in entries:
                scatter_(grads[0], entry.group, entry.d_q, accumulate=True)

        return Prepared(self, self.pack(k, v), attend, finish)


class Prepared(NamedTuple):
    """One member's part of an exchange: its packed K/V message, ``attend(block, source,
    d_block)`` for each block it computes with, and ``finish(own dK/dV or None)``."""

    piece: SpanningPiece
    kv: Tensor
    attend: Attend
    finish: Callable[[Tensor | None], None]


def run_forward_(pieces: Sequence[SpanningPiece], out: Tensor, lse: Tensor, q: Tensor,
                 k: Tensor, v: Tensor, plan: AttentionPlan) -> None:
    """Merge the attention of ``pieces`` (the members this rank holds of one piece of a
    branch, exchanged together) into ``out``/``lse``."""
    prepared = [piece.prepare_forward(out, lse, q, k, v, plan) for piece in pieces]
    _exchange(prepared, plan, None, "forward")


def run_backward_(pieces: Sequence[SpanningPiece], grads: Sequence[Tensor], d_out: Tensor,
                  d_lse: Tensor | None, saved: Sequence[Tensor], plan: AttentionPlan) -> None:
    """Add the gradients of ``pieces`` into ``grads = (dq, dk, dv)``."""
    prepared = [piece.prepare_backward(grads, d_out, d_lse, saved, plan) for piece in pieces]
    _exchange(prepared, plan, grads[0].dtype, "backward")


def _exchange(prepared: Sequence[Prepared], plan: AttentionPlan, grad_dtype: torch.dtype | None,
              phase: str) -> None:
    """Run the :class:`Schedule` of every member in ``prepared`` at once: ``attend`` for each
    block a member computes with, as the transport delivers it; then ``finish``.

    ``ring``: hop by hop, all members' messages of a hop in one batched exchange, so that two
    members on one rank (zigzag) never wait for each other. Forward (``grad_dtype`` None): no
    dK/dV. Backward: a zeroed dK/dV partial in ``grad_dtype`` travels with each block, every
    member adds into it, and it is home after the last hop.
    """
    label = f"{prepared[0].piece.label}, {phase}"
    if prepared[0].piece.transport == "allgather":
        (one,) = prepared  # the zigzag layout refuses this transport (plan_sequence_parallel)
        peers = Peers(plan.process_group, one.piece.members, one.piece.index, label)
        one.finish(one.piece._allgather(peers, one.kv, plan.causal, one.attend, grad_dtype))
        return
    hops = [list(Schedule(len(p.piece.members), p.piece.index, plan.causal).hops())
            for p in prepared]
    pieces = [p.piece for p in prepared]
    kvs = [p.kv for p in prepared]
    d_kvs = [None if grad_dtype is None else torch.zeros_like(kv, dtype=grad_dtype)
             for kv in kvs]
    for number in range(max(len(member_hops) for member_hops in hops)):
        live = [i for i, member_hops in enumerate(hops) if number < len(member_hops)]
        posted = [i for i in live if not hops[i][number].last]
        incoming = shift(plan.process_group, [(pieces[i], kvs[i]) for i in posted], number, 0,
                         label)
        for i in live:
            hop = hops[i][number]
            if hop.attended:
                prepared[i].attend(kvs[i], hop.source, d_kvs[i])
        if grad_dtype is not None:  # the dK/dV accumulators travel with their blocks
            moved = shift(plan.process_group, [(pieces[i], d_kvs[i]) for i in live], number, 1,
                          label)()
            for i, d_kv in zip(live, moved):
                d_kvs[i] = d_kv
        for i, kv in zip(posted, incoming()):
            kvs[i] = kv
    for p, d_kv in zip(prepared, d_kvs):
        p.finish(d_kv)


def shift(process_group: dist.ProcessGroup, moves: Sequence[tuple[SpanningPiece, Tensor]],
          hop: int, kind: int, label: str) -> Callable[[], list[Tensor]]:
    """Post one hop for every ``(member, tensor)`` of ``moves``: send the tensor to the next
    member of its segment group, receive the previous member's; returns a function that waits
    and gives the received tensors, in order. A message between two members on this rank is
    handed over without a send. Messages are posted in one order on both sides of every pair
    of ranks (by sender and receiver member) and tagged by receiver, so that two on one link
    cannot be confused."""
    me = dist.get_rank(process_group)
    global_ranks = dist.get_process_group_ranks(process_group)
    handed: dict[tuple[tuple[int, ...], int], Tensor] = {}
    received: list[Tensor | None] = [None] * len(moves)
    ops: list[tuple[tuple[int, int], dist.P2POp]] = []
    for i, (piece, tensor) in enumerate(moves):
        size, index = len(piece.members), piece.index
        if size == 1:
            received[i] = tensor
            continue
        after, before = (index + 1) % size, (index - 1) % size
        if piece.hosts[after] == me:
            handed[piece.members, after] = tensor
        else:
            tag = kind + 2 * piece.members[after]
            peer = global_ranks[piece.hosts[after]]
            op = dist.P2POp(dist.isend, tensor.contiguous(), peer, process_group, tag)
            ops.append(((piece.members[index], piece.members[after]), op))
        if piece.hosts[before] != me:
            received[i] = torch.empty_like(tensor)
            tag = kind + 2 * piece.members[index]
            peer = global_ranks[piece.hosts[before]]
            op = dist.P2POp(dist.irecv, received[i], peer, process_group, tag)
            ops.append(((piece.members[before], piece.members[index]), op))
    for i, (piece, _) in enumerate(moves):
        if received[i] is None:
            received[i] = handed[piece.members, piece.index]
    ops.sort(key=lambda entry: entry[0])
    where = f"rank {dist.get_rank()} ({label}) at hop {hop}"
    wait = Peers.post([op for _, op in ops], where)
    return lambda: (wait(), received)[1]


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

    Pieces come in sets run together (``run_forward_``): one member per set in the
    ``contiguous`` layout; with ``zigzag`` the members are the ``2 P`` chunks (half a shard
    each) and a set holds this rank's two members of one piece, which may share a segment
    group."""
    zigzag = layout == "zigzag"
    if zigzag and shard_len % 2:
        raise ValueError(
            f"dilated_attention: the zigzag layout cuts each shard into two equal chunks, but "
            f"the shard has {shard_len} tokens (odd). Pad the sequence to "
            f"longnet.attention.padded_length(N, pattern, {2 * world_size}) tokens."
        )
    chunk_len = shard_len // 2 if zigzag else shard_len
    chunks = 2 * world_size if zigzag else world_size
    seq_len = chunk_len * chunks
    members_here = ((0, rank), (1, chunks - 1 - rank)) if zigzag else ((None, rank),)
    local: list[list[BlockGroup]] = []
    sets: list[tuple[SpanningPiece, ...]] = []
    for (w, r), transport in zip(pattern.branches, transports):
        segment = min(w, seq_len)
        if not branch_fits(segment, chunk_len):
            unit = f"zigzag chunk length {chunk_len}" if zigzag else f"shard length {chunk_len}"
            raise ValueError(
                f"dilated_attention: branch (w={w}, r={r}) cannot be split over {world_size} "
                f"ranks: its segment length {segment} neither divides nor is a multiple of the "
                f"{unit}. Pad the sequence to longnet.attention.padded_length({seq_len}, "
                f"pattern, {chunks}) = {padded_length(seq_len, pattern, chunks)} tokens, or "
                "change the pattern."
            )
        if segment <= chunk_len:  # a chunk holds whole segments: so does a zigzag shard
            local.append(branch_groups(shard_len, num_heads, segment, r))
            continue
        if zigzag and transport != "ring":
            raise ValueError(
                f"dilated_attention: the zigzag layout runs the ring transport only; branch "
                f"(w={w}, r={r}) asks for {transport!r}. Use transport='ring'."
            )
        per_member = []
        for half, member in members_here:
            start, members = segment_group(member, chunk_len, segment, seq_len)
            hosts = tuple(chunk_host(m, world_size, layout) for m in members)
            rows = None if half is None else (half * chunk_len, (half + 1) * chunk_len)
            member_groups = tuple(
                tuple(region_groups(0, chunk_len, 1, num_heads, r, shift=m * chunk_len - start))
                for m in members
            )
            index = member - members[0]
            pieces = []
            for heads, groups in ring_pieces(member_groups, num_heads, row_elements,
                                             block_elements):
                label = f"branch w={w} r={r} heads {heads[0]}-{heads[-1]}"
                queries = query_groups(groups[index], groups)
                pieces.append(SpanningPiece(members, index, groups, transport, label, heads,
                                            queries, hosts, rows))
            per_member.append(pieces)
        sets += list(zip(*per_member))
    return local, sets


def segment_group(
    rank: int, shard_len: int, segment: int, seq_len: int
) -> tuple[int, tuple[int, ...]]:
    """``(start, members)`` for a branch whose ``segment`` (a multiple of ``shard_len``) spans
    ranks: the first token of ``rank``'s segment and the ranks holding it, in sequence order
    (the last segment may be cut at ``seq_len``)."""
    start = rank * shard_len // segment * segment
    return start, tuple(range(start // shard_len, min(start + segment, seq_len) // shard_len))


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
