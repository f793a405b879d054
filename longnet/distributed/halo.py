"""The rows before each stripe of this rank's sequence shard (a "halo"), differentiable: what a
causal convolution of width ``k`` needs (``k - 1`` rows) over a sharded sequence. Each stripe's
tail goes to the holder of the next stripe (``longnet.distributed.layouts``); its gradient comes
back in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.distributed.layouts import (
    check_layout,
    rank_stripes,
    stripe_count,
    stripe_host,
    stripe_slot,
    stripes_per_rank,
)


def previous_rows(
    x: Tensor, rows: int, group: dist.ProcessGroup, layout: str = "contiguous"
) -> Tensor:
    """The ``rows`` rows before each stripe of this rank's shard ``x`` ``(batch, shard_len,
    channels)``: ``(batch, stripes * rows, channels)``, one halo per stripe in shard order;
    zeros before the sequence's first token."""
    check_layout(layout, "previous_rows")
    stripes = stripes_per_rank(layout)
    if rows > x.shape[1] // stripes:
        raise ValueError(
            f"previous_rows: {rows} rows are needed before each stripe but the {layout} layout "
            f"gives stripes of only {x.shape[1] // stripes}; use a longer sequence or fewer ranks."
        )
    return _PreviousRows.apply(x, rows, group, layout)


class _Links:
    """Which stripe tails this rank sends where, and which halos it receives from where:
    ``sends``/``receives`` ``(my slot, peer rank, peer slot)``, ``local`` ``(from, to)``."""

    def __init__(self, rank: int, world_size: int, layout: str) -> None:
        last = stripe_count(world_size, layout) - 1
        self.sends, self.receives, self.local = [], [], []
        for slot, stripe in enumerate(rank_stripes(rank, world_size, layout)):
            if stripe < last:
                peer = stripe_host(stripe + 1, world_size, layout)
                peer_slot = stripe_slot(stripe + 1, world_size, layout)
                if peer == rank:
                    self.local.append((slot, peer_slot))
                else:
                    self.sends.append((slot, peer, peer_slot))
            if stripe > 0:
                peer = stripe_host(stripe - 1, world_size, layout)
                if peer != rank:
                    self.receives.append((slot, peer, stripe_slot(stripe - 1, world_size, layout)))


def _exchange(sends: list[tuple[Tensor, int]], receives: list[tuple[Tensor, int]], group,
              what: str) -> None:
    """Post every send and receive ``(tensor, group rank)`` at once; wait for all."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group)
           for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group)
            for t, peer in receives]
    if not ops:
        return
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except Exception as error:  # a dead or mismatched peer: say who and what
        raise RuntimeError(
            f"previous_rows: rank {dist.get_rank()} failed exchanging {what}: {error}"
        ) from error


class _PreviousRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rows: int, group: dist.ProcessGroup, layout: str) -> Tensor:
        links = _Links(dist.get_rank(group), dist.get_world_size(group), layout)
        stripes = stripes_per_rank(layout)
        stripe_len = x.shape[1] // stripes
        ctx.rows, ctx.group, ctx.shape, ctx.links = rows, group, x.shape, links
        ctx.stripes = stripes
        halo = x.new_zeros(x.shape[0], stripes, rows, x.shape[2])
        if rows == 0:
            return halo.flatten(1, 2)

        def tail(slot: int) -> Tensor:
            return x[:, (slot + 1) * stripe_len - rows : (slot + 1) * stripe_len]

        buffers = [(slot, torch.empty_like(halo[:, slot])) for slot, _, _ in links.receives]
        _exchange([(tail(slot).contiguous(), peer) for slot, peer, _ in links.sends],
                  [(buffer, peer) for (_, buffer), (_, peer, _) in zip(buffers, links.receives)],
                  group, "stripe tails (forward)")
        for slot, buffer in buffers:
            halo[:, slot] = buffer
        for source, target in links.local:
            halo[:, target] = tail(source)
        return halo.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        links, rows = ctx.links, ctx.rows
        grad_x = grad.new_zeros(ctx.shape)
        if rows == 0:
            return grad_x, None, None, None
        stripes = ctx.stripes
        stripe_len = ctx.shape[1] // stripes
        halo = grad.unflatten(1, (stripes, rows))
        tails = [(slot, grad.new_empty(grad.shape[0], rows, grad.shape[2]))
                 for slot, _, _ in links.sends]
        _exchange([(halo[:, slot].contiguous(), peer) for slot, peer, _ in links.receives],
                  [(buffer, peer) for (_, buffer), (_, peer, _) in zip(tails, links.sends)],
                  ctx.group, "stripe tail gradients (backward)")
        for slot, buffer in tails:
            grad_x[:, (slot + 1) * stripe_len - rows : (slot + 1) * stripe_len] += buffer
        for source, target in links.local:
            grad_x[:, (source + 1) * stripe_len - rows : (source + 1) * stripe_len] += \
                halo[:, target]
        return grad_x, None, None, None
