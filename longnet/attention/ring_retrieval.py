"""The retrieval branches under sequence parallelism (docs/architecture.md §4). Each rank's
queries stay; its shard of ``k, v`` (and far key rows) travels once around the group, and
every rank adds the sinks, neighbours and chosen blocks that lie in the shard it holds,
merged by log-sum-exp; in the backward their gradients travel with the shard back to its
owner. Choosing blocks needs every block's key bounds: one all-reduce (minimum, maximum) of
``(blocks, kv_heads, head_dim)``, a ``block``-th of the keys. A shard is one stripe of the
sequence (contiguous layout) or two (zigzag), each a window of positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from longnet.attention.pattern import DilatedPattern
from longnet.attention.retrieval import (
    accumulate_,
    output_delta,
    retrieval_backward,
    retrieval_forward,
)
from longnet.attention.ring import Peers
from longnet.attention.selection import (
    Retrieval,
    RowGeometry,
    Selection,
    block_bounds,
    row_geometry,
)
from longnet.distributed.layouts import rank_stripes, stripes_per_rank

Stripe = tuple[int, slice]
"""``(first position, rows of the shard)`` of one stripe of a rank's shard."""


def ring_retrieval(
    q: Tensor, k: Tensor, v: Tensor, pattern: DilatedPattern, retrieval: Retrieval, *,
    causal: bool, scale: float, documents: Sequence[Sequence[int]] | None,
    group: dist.ProcessGroup, layout: str, far_qk: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The retrieval branches of this rank's shard, to be merged with the dilated ones by
    :func:`~longnet.attention.retrieval.merge_attention`.

    Args:
        q: ``(batch, shard, heads, head_dim)``; k, v: ``(batch, shard, kv_heads, head_dim)``,
            this rank's shard of the ``group``'s sequence in ``layout``.
        documents: every batch element's document lengths over the whole sequence, or None.
        far_qk: ``(far_q, far_k)`` like ``q, k`` that sinks and blocks score with (default
            ``q, k``).
    Returns:
        ``out`` ``(batch, shard, heads, head_dim)`` in ``q``'s dtype and ``lse`` ``(batch,
        heads, shard)``; 0 and ``-inf`` where a query has no such key.
    """
    far_q, far_k = (q, k) if far_qk is None else far_qk
    size = dist.get_world_size(group)
    stripes = [shard_stripes(rank, size, layout, q.shape[1]) for rank in range(size)]
    mine = stripes[dist.get_rank(group)]
    rows = [[row_geometry((q.shape[1] * size,) if documents is None else tuple(documents[b]),
                          part.stop - part.start, pattern, retrieval, q.device,
                          first_query=first) for first, part in mine]
            for b in range(q.shape[0])]
    bounds = _reduce_bounds([_stripe_bounds(far_k[b].detach(), rows[b][0], retrieval, mine)
                             for b in range(q.shape[0])], group)
    selections = [[Selection.make(far_q[b, part].detach(), row, bounds[b], retrieval, causal)
                   for row, (_, part) in zip(rows[b], mine)] for b in range(q.shape[0])]
    return _RingRetrieval.apply(q, k, v, *(far_qk or (None, None)), selections, stripes,
                                retrieval, causal, scale, group)


def shard_stripes(rank: int, world_size: int, layout: str, shard: int) -> list[Stripe]:
    """The :data:`Stripe` s of ``rank``'s shard of ``shard`` rows."""
    length = shard // stripes_per_rank(layout)
    return [(stripe * length, slice(slot * length, (slot + 1) * length))
            for slot, stripe in enumerate(rank_stripes(rank, world_size, layout))]


class _Turn:
    """One turn of every shard's ``message`` ``(2 or 3, batch, shard, kv_heads, head_dim)``
    around the group: iterating gives ``(query stripe number, query rows, first key position,
    key rows, message held)`` per pair of a stripe of this rank's queries and a stripe of the
    shard held (causal: not the key stripes wholly after the query stripe), the next shard
    posted before the hop's work. ``carry`` (the backward's gradients of the shard held)
    travels after each hop and is home after the turn."""

    def __init__(self, group: dist.ProcessGroup, message: Tensor, stripes: list[list[Stripe]],
                 causal: bool, label: str, carry: Tensor | None = None) -> None:
        self.group, self.message, self.stripes = group, message, stripes
        self.causal, self.label, self.carry = causal, label, carry

    def __iter__(self) -> Iterator[tuple[int, slice, int, slice, Tensor]]:
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        for hop in range(size):
            source = (rank - hop) % size
            last = hop + 1 == size
            incoming = None if last else _pass_on(self.group, self.message, 0, self.label)
            for number, (query_first, queries) in enumerate(self.stripes[rank]):
                for keys_from, keys in self.stripes[source]:
                    query_end = query_first + queries.stop - queries.start
                    if not (self.causal and keys_from >= query_end):
                        yield number, queries, keys_from, keys, self.message
            if self.carry is not None:
                self.carry = _pass_on(self.group, self.carry, 1, f"{self.label}, gradients")()
            if incoming is not None:
                self.message = incoming()


class _RingRetrieval(torch.autograd.Function):
    """Sinks, neighbours and chosen blocks of the shard each hop brings; the backward sends
    the accumulated ``dk, dv`` (and ``d_far_k``) along with the shard they belong to. Without
    far rows (None) the message is ``(k, v)``: ``k`` serves as both."""

    @staticmethod
    def forward(ctx, q, k, v, far_q, far_k, selections, stripes, retrieval, causal, scale,
                group):
        compute = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape, dtype=compute)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=compute)
        rows_q = q if far_q is None else far_q
        message = torch.stack((k, v) if far_k is None else (k, v, far_k))
        far = 0 if far_k is None else 2  # the far key rows' place in the message
        for number, queries, keys_from, keys, held in _Turn(group, message, stripes, causal,
                                                             "forward"):
            for b, selection in enumerate(selections):
                rows = held[:, b, keys]
                part = retrieval_forward(q[b, queries], rows[0], rows[1], rows_q[b, queries],
                                         rows[far], selection[number], retrieval, causal, scale,
                                         keys_from)
                accumulate_(out[b], lse[b], queries, *part)
        ctx.save_for_backward(q, k, v, far_q, far_k, out, lse)
        ctx.call = selections, stripes, retrieval, causal, scale, group
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), rearrange(lse, "b n h -> b h n")

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, far_q, far_k, out, lse = ctx.saved_tensors
        selections, stripes, retrieval, causal, scale, group = ctx.call
        d_rows, delta = output_delta(d_out, None if d_lse is None
                                     else rearrange(d_lse, "b h n -> b n h"), out)
        rows_q = q if far_q is None else far_q
        dq, d_far_q = (torch.zeros_like(t, dtype=lse.dtype) for t in (q, rows_q))
        message = torch.stack((k, v) if far_k is None else (k, v, far_k))
        far = 0 if far_k is None else 2
        turn = _Turn(group, message, stripes, causal, "backward",
                     carry=torch.zeros_like(message, dtype=lse.dtype))
        for number, queries, keys_from, keys, held in turn:
            for b, selection in enumerate(selections):
                rows = held[:, b, keys]
                d_q, d_k, d_far_q_b, d_far_k, d_v = retrieval_backward(
                    d_rows[b, queries], delta[b, queries], q[b, queries], rows[0], rows[1],
                    rows_q[b, queries], rows[far], lse[b, queries], selection[number],
                    retrieval, causal, scale, keys_from)
                dq[b, queries] += d_q
                d_far_q[b, queries] += d_far_q_b
                turn.carry[:, b, keys] += torch.stack((d_k + d_far_k, d_v) if far_k is None
                                                      else (d_k, d_v, d_far_k))
        grads = turn.carry  # back home after a whole turn
        d_k, d_v = grads[0].to(k.dtype), grads[1].to(v.dtype)
        if far_q is None:
            dq, d_far_q = dq + d_far_q, None
        d_far_k = None if far_k is None else grads[2].to(far_k.dtype)
        return (dq.to(q.dtype), d_k, d_v, None if d_far_q is None else d_far_q.to(far_q.dtype),
                d_far_k, *(None,) * 6)


def _stripe_bounds(far_k: Tensor, row: RowGeometry, retrieval: Retrieval,
                   mine: list[Stripe]) -> tuple[Tensor, Tensor]:
    """:func:`block_bounds` over the keys of this rank's stripes (``far_k`` ``(shard,
    kv_heads, head_dim)``)."""
    parts = [block_bounds(far_k[rows], row, retrieval, keys_from=first) for first, rows in mine]
    low, high = parts[0]
    for part_low, part_high in parts[1:]:
        low, high = torch.minimum(low, part_low), torch.maximum(high, part_high)
    return low, high


def _pass_on(group: dist.ProcessGroup, tensor: Tensor, tag: int,
             where: str) -> Callable[[], Tensor]:
    """Send ``tensor`` to the next rank of ``group`` and receive the previous rank's; returns
    a function that waits and gives it (a failure names this rank and ``where``)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), ranks[(rank + 1) % size], group, tag),
           dist.P2POp(dist.irecv, received, ranks[(rank - 1) % size], group, tag)]
    wait = Peers.post(ops, f"rank {dist.get_rank()} (retrieval branches, {where})")
    return lambda: (wait(), received)[1]


def _reduce_bounds(bounds: list[tuple[Tensor, Tensor]],
                   group: dist.ProcessGroup) -> list[tuple[Tensor, Tensor]]:
    """Every block's bounds over the whole sequence: the minima's minimum and the maxima's
    maximum over the ranks (each rank's ``+inf`` / ``-inf`` where it holds none of a block)."""
    lows, highs = (torch.cat([pair[i].flatten() for pair in bounds]) for i in (0, 1))
    if lows.numel():
        dist.all_reduce(lows, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
    sizes = [low.numel() for low, _ in bounds]
    return [(low.view_as(like), high.view_as(like)) for low, high, (like, _)
            in zip(lows.split(sizes), highs.split(sizes), bounds)]
