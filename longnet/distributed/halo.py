"""The last rows of the previous rank's sequence shard (a "halo"), differentiable.

A causal convolution of width ``k`` over a sequence split into contiguous shards (group rank
``i`` holds shard ``i``) needs, on each rank, the ``k - 1`` rows before its shard. Forward:
every rank sends its last ``rows`` rows to the next rank and receives the previous rank's
(rank 0 receives zeros). Backward: the gradient of the received rows goes back to the rank
they came from and is added to its last rows' gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def previous_rows(x: Tensor, rows: int, group: dist.ProcessGroup) -> Tensor:
    """The ``rows`` rows before this rank's shard ``x`` ``(batch, shard_len, channels)``:
    the previous group rank's last rows, zeros on group rank 0. Returns
    ``(batch, rows, channels)``; gradients flow back to the rank that sent them."""
    if rows > x.shape[1]:
        raise ValueError(
            f"previous_rows: {rows} rows are needed from the previous rank but shards hold "
            f"only {x.shape[1]}; use a longer sequence or fewer ranks."
        )
    return _PreviousRows.apply(x, rows, group)


def _exchange(send: Tensor | None, to: int, receive: Tensor | None, source: int, group, what):
    """Post one send (``send`` to group rank ``to``) and one receive (into ``receive`` from
    group rank ``source``), either of them ``None`` to skip, and wait for both."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, to), group))
    if receive is not None:
        ops.append(dist.P2POp(dist.irecv, receive, dist.get_global_rank(group, source), group))
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
    def forward(ctx, x: Tensor, rows: int, group: dist.ProcessGroup) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ctx.rows, ctx.group, ctx.shape = rows, group, x.shape
        received = x.new_zeros(x.shape[0], rows, x.shape[2])
        if rows == 0:
            return received
        _exchange(
            x[:, x.shape[1] - rows :].contiguous() if rank + 1 < size else None,
            rank + 1,
            received if rank > 0 else None,
            rank - 1,
            group,
            "shard tails (forward)",
        )
        return received

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        grad_x = grad.new_zeros(ctx.shape)
        if ctx.rows == 0:
            return grad_x, None, None
        tail_grad = grad.new_zeros(grad.shape) if rank + 1 < size else None
        _exchange(
            grad.contiguous() if rank > 0 else None,
            rank - 1,
            tail_grad,
            rank + 1,
            ctx.group,
            "shard tail gradients (backward)",
        )
        if tail_grad is not None:
            grad_x[:, ctx.shape[1] - ctx.rows :] = tail_grad
        return grad_x, None, None
