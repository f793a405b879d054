"""The branches whose segments lie on this device: every chunk of the plan as one kernel call,
folded into the accumulators (docs/architecture.md §3).

The first local branch covers each row and head at most once, so its chunks are copied in;
every later chunk is merged by log-sum-exp (``merge``). With ``plan.adopted``, the first branch
runs as one kernel call whose outputs become the accumulators themselves.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.blocks import gather, scatter_
from longnet.attention.merge import BackwardQueries, accumulators, merge_into_
from longnet.attention.plan import AttentionPlan


def _sequence_layout(block: Tensor, batch: int) -> Tensor:
    """Kernel-layout result ``(batch * segments, heads, rows[, dim])`` of a whole branch -> the
    accumulator layout ``(batch, seq, heads, dim)`` (or ``(batch, seq, heads, 1)`` for lse).
    A view when the kernel wrote sequence-major memory (ATen's fused ops do)."""
    if block.dim() == 3:
        block = block[..., None]
    return rearrange(block, "(b n) h w d -> b (n w) h d", b=batch).contiguous()


def attend_local(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> tuple[Tensor, Tensor]:
    """``out, lse`` accumulators (``(batch, seq, heads, dim)``, ``(batch, seq, heads, 1)``)
    holding the attention of every local block of the plan."""
    forward, causal, scale = plan.kernel.forward, plan.causal, plan.scale
    if plan.adopted is None:
        out, lse = accumulators(q)
    else:
        group = plan.adopted
        block_out, block_lse = forward(gather(q, group), gather(k, group), gather(v, group),
                                       causal, scale)
        out, lse = _sequence_layout(block_out, q.shape[0]), _sequence_layout(block_lse, q.shape[0])
    for index, chunk in plan.chunks:
        block_out, block_lse = forward(gather(q, chunk), gather(k, chunk), gather(v, chunk),
                                       causal, scale)
        merge_into_(out, lse, chunk, block_out, block_lse, fresh=index == 0)
        del block_out, block_lse  # free before the next kernel call allocates its outputs
    return out, lse


def attend_local_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_lse: Tensor | None,
    plan: AttentionPlan,
) -> list[Tensor]:
    """Gradient accumulators ``[dq, dk, dv]`` ``(batch, seq, heads, dim)`` (accumulation
    dtype) of every local block, given the global ``out``/``lse`` (sequence layout) and the
    upstream gradients ``d_out`` and ``d_lse`` (``(batch, seq, heads, 1)`` or None)."""
    kernel, causal, scale = plan.kernel, plan.causal, plan.scale
    chunks = list(plan.chunks)
    if plan.adopted is not None and d_lse is None:
        group = plan.adopted
        rows = BackwardQueries.gather(d_out, q, out, lse, None, group)
        block_grads = kernel.backward(rows.block(gather(k, group), gather(v, group)), causal,
                                      scale)
        grads = [_sequence_layout(grad, q.shape[0]) for grad in block_grads]
        del rows, block_grads
    else:
        grads = [torch.zeros(q.shape, dtype=lse.dtype, device=q.device) for _ in range(3)]
        if plan.adopted is not None:  # a gradient into lse: the adopted branch in chunks too
            row_elements = q.shape[0] * q.shape[-1]
            chunks[:0] = [(0, c) for c in plan.adopted.chunks(plan.block_elements, row_elements)]
    for _, chunk in chunks:
        rows = BackwardQueries.gather(d_out, q, out, lse, d_lse, chunk)
        block_grads = kernel.block_backward(
            rows.block(gather(k, chunk), gather(v, chunk)), rows.d_lse, causal, scale
        )
        del rows
        for grad, block_grad in zip(grads, block_grads):
            scatter_(grad, chunk, block_grad, accumulate=True)
        del block_grads  # free before the next chunk's gathers and kernel call
    return grads
