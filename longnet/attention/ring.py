"""The branches whose segments span ranks: queries stay, selected K/V rows travel
(docs/architecture.md §4). Per :class:`~longnet.attention.plan.SpanningPiece`, each member
packs its K/V rows into one message (:func:`pack`) and attends every block it receives
(:func:`arriving_blocks`, on the one :class:`Schedule` of forward, backward and memory models).
Both transports (:func:`shift`: ``ring``; :class:`Peers`: ``allgather``) name the rank and step
when a peer fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.blocks import gather, scatter_
from longnet.attention.kernels import BackwardQueries, QueryRows, accumulation_dtype, lse_merge_
from longnet.attention.plan import AttentionPlan, SpanningPiece

Arrival = tuple[int, int, Tensor, Tensor | None]
"""``(member, source, block, dK/dV)``: ``pieces[member]`` computes with member ``source``'s
K/V ``block``, adding its gradient into ``dK/dV`` (None in the forward)."""


def ring_forward_(pieces: Sequence[SpanningPiece], out: Tensor, lse: Tensor, q: Tensor,
                  k: Tensor, v: Tensor, plan: AttentionPlan, group: dist.ProcessGroup) -> None:
    """Merge the attention of ``pieces`` (this rank's members of one piece) into ``out``
    ``(batch, shard, heads, dim)`` and ``lse`` ``(batch, shard, heads, 1)``, in place."""
    queries = [
        [(QueryRows.gather(piece.rows(out), piece.rows(lse), g), gather(piece.rows(q), g))
         for g in piece.query_groups]
        for piece in pieces
    ]
    kvs = [pack(piece, piece.rows(k), piece.rows(v)) for piece in pieces]
    label = f"{pieces[0].label}, forward"
    for member, source, kv, _ in arriving_blocks(group, pieces, kvs, plan.causal, label):
        piece = pieces[member]
        diagonal = plan.causal and source == piece.index
        for number, _, k_block, v_block in key_blocks(piece, kv, source):
            rows, q_block = queries[member][number]
            block_out, block_lse = plan.kernel.forward(q_block, k_block, v_block, diagonal,
                                                       plan.scale)
            lse_merge_(rows.out, rows.lse, block_out, block_lse)
    for piece, member_queries in zip(pieces, queries):
        for rows, _ in member_queries:
            rows.write_back_(piece.rows(out), piece.rows(lse))


def ring_backward_(pieces: Sequence[SpanningPiece], grads: Sequence[Tensor], d_out: Tensor,
                   d_lse: Tensor | None, saved: Sequence[Tensor], plan: AttentionPlan,
                   group: dist.ProcessGroup) -> None:
    """Add the gradients of ``pieces`` into ``grads = (dq, dk, dv)``, in place; ``saved = (q,
    k, v, out, lse)`` with the global merged results; ``d_lse`` or None."""
    entries = []
    for piece in pieces:
        q, _, _, out, lse = (piece.rows(t) for t in saved)
        d_lse_rows = None if d_lse is None else piece.rows(d_lse)
        member = []
        for g in piece.query_groups:
            rows = BackwardQueries.gather(piece.rows(d_out), q, out, lse, d_lse_rows, g)
            member.append((rows, torch.zeros_like(rows.q, dtype=grads[0].dtype)))
        entries.append(member)
    kvs = [pack(piece, piece.rows(saved[1]), piece.rows(saved[2])) for piece in pieces]
    homes: list[Tensor | None] = [None] * len(pieces)
    label = f"{pieces[0].label}, backward"
    for member, source, kv, d_kv in arriving_blocks(group, pieces, kvs, plan.causal, label,
                                                    homes):
        piece = pieces[member]
        diagonal = plan.causal and source == piece.index
        for number, heads, k_block, v_block in key_blocks(piece, kv, source):
            rows, d_q_rows = entries[member][number]
            d_q, d_k, d_v = plan.kernel.block_backward(
                rows.block(k_block, v_block), rows.d_lse, diagonal, plan.scale
            )
            d_q_rows += d_q
            d_kv[0][:, heads, : k_block.shape[-2]] += d_k
            d_kv[1][:, heads, : k_block.shape[-2]] += d_v
    for piece, member_entries, home in zip(pieces, entries, homes):
        d_q, d_k, d_v = (piece.rows(grad) for grad in grads)
        unpack_add_(piece, d_k, d_v, home)
        for g, (_, d_q_rows) in zip(piece.query_groups, member_entries):
            scatter_(d_q, g, d_q_rows, accumulate=True)


def arriving_blocks(
    group: dist.ProcessGroup, pieces: Sequence[SpanningPiece], kvs: list[Tensor], causal: bool,
    label: str, homes: list[Tensor | None] | None = None,
) -> Iterator[Arrival]:
    """Every block each member computes with, as delivered (``kvs`` is consumed); with
    ``homes`` (backward), with a zeroed dK/dV, summed for member ``i``'s block in ``homes[i]``."""
    if pieces[0].transport == "ring":
        yield from _ring(group, pieces, kvs, causal, label, homes)
    else:  # the zigzag layout refuses this transport: one member per set
        yield from _allgather(group, pieces, kvs, causal, label, homes)


def _ring(group: dist.ProcessGroup, pieces: Sequence[SpanningPiece], kvs: list[Tensor],
          causal: bool, label: str, homes: list[Tensor | None] | None) -> Iterator[Arrival]:
    """The ``ring`` transport: each hop's messages in one batched exchange, posted before the
    current block is computed; in the backward dK/dV accumulators travel with the blocks."""
    hops = [list(Schedule(len(p.members), p.index, causal).hops()) for p in pieces]
    d_kvs = [None if homes is None else torch.zeros_like(kv, dtype=accumulation_dtype(kv.dtype))
             for kv in kvs]
    for number in range(max(len(member_hops) for member_hops in hops)):
        live = [i for i, member_hops in enumerate(hops) if number < len(member_hops)]
        posted = [i for i in live if not hops[i][number].last]
        incoming = shift(group, [(pieces[i], kvs[i]) for i in posted], number, 0, label)
        for i in live:
            hop = hops[i][number]
            if hop.attended:
                yield i, hop.source, kvs[i], d_kvs[i]
        if homes is not None:  # the dK/dV accumulators travel with their blocks
            moved = shift(group, [(pieces[i], d_kvs[i]) for i in live], number, 1, label)()
            for i, d_kv in zip(live, moved):
                d_kvs[i] = d_kv
        for i, kv in zip(posted, incoming()):
            kvs[i] = kv
    if homes is not None:
        homes[:] = d_kvs


def _allgather(group: dist.ProcessGroup, pieces: Sequence[SpanningPiece], kvs: list[Tensor],
               causal: bool, label: str, homes: list[Tensor | None] | None) -> Iterator[Arrival]:
    """The ``allgather`` transport: every block at once; dK/dV partials go to their owners."""
    (piece,) = pieces
    schedule = Schedule(len(piece.members), piece.index, causal)
    peers = Peers(group, piece.members, piece.index, label)
    gathered = peers.all_gather(kvs.pop())
    partials: list[Tensor | None] = [None] * schedule.size
    for source in schedule.sources:
        if homes is not None:
            partials[source] = torch.zeros_like(
                gathered[source], dtype=accumulation_dtype(gathered[source].dtype)
            )
        yield 0, source, gathered[source], partials[source]
    if homes is not None:
        homes[0] = peers.reduce_to_owners(partials, schedule)


def pack(piece: SpanningPiece, k: Tensor, v: Tensor) -> Tensor:
    """The member's selected K and V rows as one message ``(2, batch, heads, rows_max, dim)``."""
    batch = piece.message_batch or k.shape[0]
    packed = k.new_zeros(2, batch, len(piece.heads), piece.rows_max, k.shape[-1])
    for g in piece.member_groups[piece.index]:
        index = piece.positions(g.heads, k.device)
        packed[0][:, index, : g.rows] = gather(k, g)
        packed[1][:, index, : g.rows] = gather(v, g)
    return packed


def unpack_add_(piece: SpanningPiece, d_k: Tensor, d_v: Tensor, packed: Tensor) -> None:
    """Add a :func:`pack`-shaped gradient of the member's rows into ``d_k``/``d_v``."""
    for g in piece.member_groups[piece.index]:
        index = piece.positions(g.heads, d_k.device)
        scatter_(d_k, g, packed[0][:, index, : g.rows], accumulate=True)
        scatter_(d_v, g, packed[1][:, index, : g.rows], accumulate=True)


def key_blocks(
    piece: SpanningPiece, kv: Tensor, source: int
) -> Iterator[tuple[int, slice | Tensor, Tensor, Tensor]]:
    """``(query group number, head index, k block, v block)`` of the query groups meeting ``kv``."""
    for number, query_group in enumerate(piece.query_groups):
        rows = piece.key_rows(query_group, source)
        if rows:
            index = piece.positions(query_group.heads, kv.device)
            yield number, index, kv[0][:, index, :rows], kv[1][:, index, :rows]


# -- the transports --------------------------------------------------------------------------------
class Hop(NamedTuple):
    """One hop of the ``ring`` transport, seen from one member of a segment group."""

    number: int
    source: int  # the member whose K/V block this rank holds during the hop
    attended: bool  # whether this rank computes with that block
    last: bool  # no block arrives after this hop (nothing to post)


@dataclass(frozen=True)
class Schedule:
    """Who computes with whose K/V block in a segment group, seen from member ``index``;
    causal: member ``i`` only with members ``0..i`` (later keys are all in its future)."""

    size: int
    index: int
    causal: bool

    def attends(self, reader: int, source: int) -> bool:
        """Whether member ``reader`` computes with member ``source``'s block."""
        return not (self.causal and source > reader)

    @property
    def sources(self) -> list[int]:
        """The members whose blocks this rank computes with, in member order."""
        return [source for source in range(self.size) if self.attends(self.index, source)]

    @property
    def readers(self) -> list[int]:
        """The other members that compute with this rank's block."""
        members = range(self.size)
        return [m for m in members if m != self.index and self.attends(m, self.index)]

    def hops(self) -> Iterator[Hop]:
        """``ring``: at hop ``h`` this rank holds member ``index - h``'s block. Every member
        joins every hop, attended or not (skipping one would leave its peers waiting)."""
        for number in range(self.size):
            source = (self.index - number) % self.size
            yield Hop(number, source, self.attends(self.index, source), number + 1 == self.size)


class Peers:
    """Batched all-gather and reduce among the ``members`` (group ranks, in sequence order) of
    one segment group; ``index``: this rank's place; ``where``: how errors name the step."""

    def __init__(
        self, process_group: dist.ProcessGroup, members: Sequence[int], index: int, where: str
    ) -> None:
        group_ranks = dist.get_process_group_ranks(process_group)
        self.process_group = process_group
        self.index = index
        self.ranks = [group_ranks[member] for member in members]
        self.where = f"rank {dist.get_rank()} ({where})"

    @staticmethod
    def post(ops: list[dist.P2POp], where: str) -> Callable[[], None]:
        """Start ``ops`` as one batch; returns a function that waits for them (keeping their
        tensors alive), raising an error that names ``where``."""
        works = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
            except Exception as error:  # a dead or mismatched peer: say who and where
                raise RuntimeError(f"dilated_attention: {where} failed: {error}") from error
            ops.clear()

        return wait

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every member's ``tensor`` (same shape everywhere), in member order."""
        gathered = [
            tensor if m == self.index else torch.empty_like(tensor) for m in range(len(self.ranks))
        ]
        ops = []
        for member, rank in enumerate(self.ranks):
            if member != self.index:
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), rank, self.process_group))
                ops.append(dist.P2POp(dist.irecv, gathered[member], rank, self.process_group))
        if ops:
            self.post(ops, f"{self.where} at all-gather among ranks {self.ranks}")()
        return gathered

    def reduce_to_owners(self, partials: list[Tensor | None], schedule: Schedule) -> Tensor:
        """Send ``partials[m]`` (if any) to member ``m``; return the total for our block."""
        total = partials[self.index].clone()
        readers = schedule.readers
        received, ops = [], []
        for member, rank in enumerate(self.ranks):
            if member != self.index and partials[member] is not None:
                ops.append(dist.P2POp(dist.isend, partials[member], rank, self.process_group))
            if member in readers:
                buffer = torch.empty_like(total)
                received.append(buffer)
                ops.append(dist.P2POp(dist.irecv, buffer, rank, self.process_group))
        if ops:
            self.post(ops, f"{self.where} at reduce among ranks {self.ranks}")()
        for buffer in received:
            total += buffer
        return total


def shift(process_group: dist.ProcessGroup, moves: Sequence[tuple[SpanningPiece, Tensor]],
          hop: int, kind: int, label: str) -> Callable[[], list[Tensor]]:
    """One ``ring`` hop: send each of ``moves`` to the next member and receive the previous
    one's; returns a function that waits and gives them. Posted in one order on both sides and
    tagged by receiver and ``kind`` (0: K/V, 1: dK/dV): two on one link cannot be confused."""
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
