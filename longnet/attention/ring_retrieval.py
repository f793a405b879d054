"""The retrieval branches under sequence parallelism (docs/architecture.md §4). Each rank's
queries stay; its shard of ``k, v, far_k`` travels once around the group, and every rank adds
the sinks, neighbours and chosen blocks that lie in the shard it holds, merged by log-sum-exp;
in the backward their gradients travel with the shard back to its owner. Choosing blocks
needs every block's key bounds: one all-reduce (minimum, maximum) of ``(blocks, kv_heads,
head_dim)``, a ``block``-th of the keys. Contiguous shards only.
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
from longnet.attention.selection import Retrieval, Selection, block_bounds, row_geometry


def ring_retrieval(
    q: Tensor, k: Tensor, v: Tensor, pattern: DilatedPattern, retrieval: Retrieval, *,
    causal: bool, scale: float, documents: Sequence[Sequence[int]] | None,
    group: dist.ProcessGroup, far_qk: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The retrieval branches of this rank's contiguous shard, to be merged with the dilated
    ones by :func:`~longnet.attention.retrieval.merge_attention`.

    Args:
        q: ``(batch, shard, heads, head_dim)``; k, v: ``(batch, shard, kv_heads, head_dim)``,
            rank ``r`` of the ``group`` holding positions ``[r * shard, (r + 1) * shard)``.
        documents: every batch element's document lengths over the whole sequence, or None.
        far_qk: ``(far_q, far_k)`` like ``q, k`` that sinks and blocks score with (default
            ``q, k``).
    Returns:
        ``out`` ``(batch, shard, heads, head_dim)`` in ``q``'s dtype and ``lse`` ``(batch,
        heads, shard)``; 0 and ``-inf`` where a query has no such key.
    """
    far_q, far_k = (q, k) if far_qk is None else far_qk
    shard, size = q.shape[1], dist.get_world_size(group)
    first = dist.get_rank(group) * shard
    rows = [row_geometry((shard * size,) if documents is None else tuple(documents[b]), shard,
                         pattern, retrieval, q.device, first_query=first)
            for b in range(q.shape[0])]
    bounds = _reduce_bounds([block_bounds(far_k[b].detach(), row, retrieval, keys_from=first)
                             for b, row in enumerate(rows)], group)
    selections = [Selection.make(far_q[b].detach(), row, bound, retrieval, causal)
                  for b, (row, bound) in enumerate(zip(rows, bounds))]
    return _RingRetrieval.apply(q, k, v, *(far_qk or (None, None)), selections, retrieval,
                                causal, scale, group)


class _RingRetrieval(torch.autograd.Function):
    """Sinks, neighbours and chosen blocks of the shard each hop brings; the backward sends
    the accumulated ``dk, dv`` (and ``d_far_k``) along with the shard they belong to. Without
    far rows (None) the message is ``(k, v)``: ``k`` serves as both."""

    @staticmethod
    def forward(ctx, q, k, v, far_q, far_k, selections, retrieval, causal, scale, group):
        compute = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape, dtype=compute)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=compute)
        rows_q = q if far_q is None else far_q
        message = torch.stack((k, v) if far_k is None else (k, v, far_k))
        far = 0 if far_k is None else 2  # the far key rows' place in the message
        for source, last in _hops(group, causal):
            incoming = None if last else _pass_on(group, message, 0, "forward")
            if source is not None:
                keys_from = source * q.shape[1]
                for b, selection in enumerate(selections):
                    k_b, v_b = message[0, b], message[1, b]
                    part = retrieval_forward(q[b], k_b, v_b, rows_q[b], message[far, b],
                                             selection, retrieval, causal, scale, keys_from)
                    accumulate_(out[b], lse[b], slice(None), *part)
            if incoming is not None:
                message = incoming()
        ctx.save_for_backward(q, k, v, far_q, far_k, out, lse)
        ctx.call = selections, retrieval, causal, scale, group
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), rearrange(lse, "b n h -> b h n")

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, far_q, far_k, out, lse = ctx.saved_tensors
        selections, retrieval, causal, scale, group = ctx.call
        d_rows, delta = output_delta(d_out, None if d_lse is None
                                     else rearrange(d_lse, "b h n -> b n h"), out)
        rows_q = q if far_q is None else far_q
        dq, d_far_q = (torch.zeros_like(t, dtype=lse.dtype) for t in (q, rows_q))
        message = torch.stack((k, v) if far_k is None else (k, v, far_k))
        grads = torch.zeros_like(message, dtype=lse.dtype)  # the gradients of the shard held
        far = 0 if far_k is None else 2
        for source, last in _hops(group, causal):
            incoming = None if last else _pass_on(group, message, 0, "backward")
            if source is not None:
                keys_from = source * q.shape[1]
                for b, selection in enumerate(selections):
                    d_q, d_k, d_far_q_b, d_far_k, d_v = retrieval_backward(
                        d_rows[b], delta[b], q[b], message[0, b], message[1, b], rows_q[b],
                        message[far, b], lse[b], selection, retrieval, causal, scale, keys_from)
                    dq[b] += d_q
                    d_far_q[b] += d_far_q_b
                    grads[:, b] += torch.stack((d_k + d_far_k, d_v) if far_k is None
                                               else (d_k, d_v, d_far_k))
            grads = _pass_on(group, grads, 1, "backward, gradients")()
            if incoming is not None:
                message = incoming()
        # back home after a whole turn
        d_k, d_v = grads[0].to(k.dtype), grads[1].to(v.dtype)
        if far_q is None:
            dq, d_far_q = dq + d_far_q, None
        d_far_k = None if far_k is None else grads[2].to(far_k.dtype)
        return (dq.to(q.dtype), d_k, d_v, None if d_far_q is None else d_far_q.to(far_q.dtype),
                d_far_k, *(None,) * 5)


def _hops(group: dist.ProcessGroup, causal: bool) -> Iterator[tuple[int | None, bool]]:
    """``(source, last)`` per hop: at hop ``h`` this rank holds rank ``r - h``'s shard
    (``source``; None when ``causal`` and all of it lies in the queries' future); ``last``:
    nothing to pass on after it."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for hop in range(size):
        source = (rank - hop) % size
        yield (None if causal and source > rank else source), hop + 1 == size


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
