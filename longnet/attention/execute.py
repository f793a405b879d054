"""A call's plan executed, forward and backward: the local blocks (``local``), then the pieces
of branches spanning ranks (``ring``). The one copy of the attention math that both entry
points run: the custom op on one device (``op``) and the autograd function across a process
group (``dilated``); docs/architecture.md §3-4."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from longnet.attention.local import attend_local, attend_local_backward
from longnet.attention.plan import AttentionPlan
from longnet.attention.ring import ring_backward_, ring_forward_


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
           group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """``out`` ``(batch, seq, heads, dim)`` in ``q``'s dtype and ``lse`` ``(batch, seq, heads,
    1)`` in the accumulation dtype of ``q, k, v`` ``(batch, seq, heads, dim)`` (this rank's
    shard with ``group``; None: one device, the plan has no pieces)."""
    out, lse = attend_local(q, k, v, plan)
    for pieces in plan.pieces:
        ring_forward_(pieces, out, lse, q, k, v, plan, group)
    # a NaN query gives a NaN row, as in dense attention (ATen's CPU flash kernel returns
    # such a row as empty: out 0, lse 0); a row sum is NaN when the row holds one, and
    # costs an lse-sized temporary where isnan() would hold a bool per element of q
    nan_queries = q.sum(-1, keepdim=True).isnan()
    out.masked_fill_(nan_queries, float("nan"))
    lse.masked_fill_(nan_queries, float("nan"))
    return out.to(q.dtype), lse


def attend_backward(d_out: Tensor, d_lse: Tensor | None, saved: tuple[Tensor, ...],
                    plan: AttentionPlan, group: dist.ProcessGroup | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` ``(batch, seq, heads, dim)`` in ``q``'s dtype; ``saved = (q, k, v, out,
    lse)`` as :func:`attend` took and returned them; ``d_out`` like ``out``, ``d_lse`` like
    ``lse`` (any floating dtype) or None when no gradient flows into ``lse``."""
    q, _, _, out, lse = saved
    if d_lse is not None:
        d_lse = d_lse.to(lse.dtype)
    grads = attend_local_backward(d_out, *saved, d_lse, plan)
    for pieces in plan.pieces:
        ring_backward_(pieces, grads, d_out, d_lse, saved, plan, group)
    d_q, d_k, d_v = (grad.to(q.dtype) for grad in grads)
    return d_q, d_k, d_v
