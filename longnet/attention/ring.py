"""The branches whose segments span ranks: queries stay, selected K/V rows travel
(docs/architecture.md §4).

The plan (``plan.spanning``) cuts each such branch into pieces of a few heads
(:class:`~longnet.attention.plan.SpanningPiece`); this module runs them. Per piece, each
member packs its selected K and V rows into one message and gathers its query-side rows once;
then every block the member computes with arrives (:func:`arriving_blocks`) and is attended:

- ``ring``: the message rotates around the segment group, one batched send/recv per hop
  (``transport.shift``); the next hop is posted before the current block is computed. In the
  backward, the dK/dV accumulator travels with its block and arrives home after the full loop.
- ``allgather``: every member receives every block of its segment group at once; the backward
  sends each block's dK/dV partial sums straight to the block's owner.

The forward merges each block result into the accumulators by log-sum-exp; the backward runs
each block's kernel backward with the GLOBAL merged ``out``/``lse`` (docs/architecture.md §3).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.blocks import gather, scatter_
from longnet.attention.kernels import accumulation_dtype
from longnet.attention.merge import BackwardQueries, QueryRows, lse_merge_
from longnet.attention.plan import AttentionPlan, SpanningPiece
from longnet.attention.transport import Peers, Schedule, shift

Arrival = tuple[int, int, Tensor, Tensor | None]
"""``(member, source, block, dK/dV)``: member ``pieces[member]`` computes with member
``source``'s K/V ``block`` of its segment group, adding the block's gradient into ``dK/dV``
(backward) or None (forward)."""


def ring_forward_(pieces: Sequence[SpanningPiece], out: Tensor, lse: Tensor, q: Tensor,
                  k: Tensor, v: Tensor, plan: AttentionPlan, group: dist.ProcessGroup) -> None:
    """Merge the attention of ``pieces`` (this rank's members of one piece, exchanged together)
    into the accumulators ``out`` ``(batch, shard, heads, dim)`` and ``lse`` ``(batch, shard,
    heads, 1)``, in place; ``q, k, v`` ``(batch, shard, heads, dim)``."""
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
    """Add the gradients of ``pieces`` into ``grads = (dq, dk, dv)`` ``(batch, shard, heads,
    dim)``, in place; ``saved = (q, k, v, out, lse)``: the forward's inputs and its global
    merged results; ``d_lse`` ``(batch, shard, heads, 1)`` or None."""
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
    """Every block each member of ``pieces`` computes with (its :class:`Schedule`), as the
    piece's transport delivers it; ``kvs[i]``: member ``i``'s packed message (the list is
    consumed). With ``homes`` (the backward), each block comes with a zeroed dK/dV
    accumulator, and once the loop ends ``homes[i]`` holds the sum for member ``i``'s own
    block."""
    if pieces[0].transport == "ring":
        yield from _ring(group, pieces, kvs, causal, label, homes)
    else:  # the zigzag layout refuses this transport: one member per set
        yield from _allgather(group, pieces, kvs, causal, label, homes)


def _ring(group: dist.ProcessGroup, pieces: Sequence[SpanningPiece], kvs: list[Tensor],
          causal: bool, label: str, homes: list[Tensor | None] | None) -> Iterator[Arrival]:
    """The ``ring`` transport, hop by hop: all members' messages of a hop in one batched
    exchange, so that two members on one rank (zigzag) never wait for each other. In the
    backward a dK/dV accumulator travels with each block, every member adds into it, and it is
    home after the last hop."""
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
    """The ``allgather`` transport: every block of the segment group at once; in the backward
    each dK/dV partial goes straight to its block's owner (``Peers.reduce_to_owners``)."""
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
    """The member's selected K and V rows (``k``, ``v``: its rows of the shard) of the piece's
    heads as one message ``(2, batch, len(heads), rows_max, dim)``."""
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
    """``(query group number, head index, k block, v block)`` for every query group of the
    member that meets member ``source``'s block ``kv``; the head index places the group's
    heads in ``kv``'s head dimension."""
    for number, query_group in enumerate(piece.query_groups):
        rows = piece.key_rows(query_group, source)
        if rows:
            index = piece.positions(query_group.heads, kv.device)
            yield number, index, kv[0][:, index, :rows], kv[1][:, index, :rows]
