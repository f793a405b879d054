"""A call's plan executed, forward and backward (docs/architecture.md §3-4), and the custom ops
``longnet::dilated_attention`` and ``longnet::dilated_attention_backward`` that run it on one
device (with fake implementations for ``torch.compile``), rebuilding the cached plan from plain
arguments. The first branch's chunks are copied into the accumulators (it covers each row and
head at most once), later ones merged by log-sum-exp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from longnet.attention.blocks import Blocks, gather, scatter_
from longnet.attention.kernels import (
    BackwardQueries,
    QueryRows,
    accumulation_dtype,
    accumulators,
    lse_merge_,
)
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import AttentionPlan, Documents, plan_attention
from longnet.attention.ring import ring_backward_, ring_forward_


def _sequence_layout(block: Tensor, batch: int) -> Tensor:
    """A whole branch's kernel-layout result in the layout ``(batch, seq, heads, dim or 1)``."""
    if block.dim() == 3:
        block = block[..., None]
    return rearrange(block, "(b n) h w d -> b (n w) h d", b=batch).contiguous()


def merge_into_(
    out: Tensor, lse: Tensor, group: Blocks, block_out: Tensor, block_lse: Tensor, fresh: bool
) -> None:
    """Fold a block result into the accumulators at ``group``'s rows (``fresh``: copy it)."""
    if fresh:
        scatter_(out, group, block_out)
        scatter_(lse, group, block_lse[..., None])
        return
    rows = QueryRows.gather(out, lse, group)
    lse_merge_(rows.out, rows.lse, block_out, block_lse)
    rows.write_back_(out, lse)


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
    """Gradient accumulators ``[dq, dk, dv]`` ``(batch, seq, heads, dim)`` of every local
    block, given the global ``out``/``lse`` and ``d_lse`` ``(batch, seq, heads, 1)`` or None."""
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


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
           group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """``out`` ``(batch, seq, heads, dim)`` in ``q``'s dtype and ``lse`` ``(batch, seq, heads,
    1)`` (accumulation dtype) of this rank's ``q, k, v`` (``group`` None: one device)."""
    out, lse = attend_local(q, k, v, plan)
    for pieces in plan.pieces:
        ring_forward_(pieces, out, lse, q, k, v, plan, group)
    # a NaN query gives a NaN row, as in dense attention (ATen's CPU flash kernel gives 0);
    # a row sum costs an lse-sized temporary where isnan() would cost one bool per element
    nan_queries = q.sum(-1, keepdim=True).isnan()
    out.masked_fill_(nan_queries, float("nan"))
    lse.masked_fill_(nan_queries, float("nan"))
    return out.to(q.dtype), lse


def attend_backward(d_out: Tensor, d_lse: Tensor | None, saved: tuple[Tensor, ...],
                    plan: AttentionPlan, group: dist.ProcessGroup | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` in ``q``'s dtype; ``saved = (q, k, v, out, lse)`` of :func:`attend`;
    ``d_lse`` like ``lse`` or None."""
    q, _, _, out, lse = saved
    if d_lse is not None:
        d_lse = d_lse.to(lse.dtype)
    grads = attend_local_backward(d_out, *saved, d_lse, plan)
    for pieces in plan.pieces:
        ring_backward_(pieces, grads, d_out, d_lse, saved, plan, group)
    d_q, d_k, d_v = (grad.to(q.dtype) for grad in grads)
    return d_q, d_k, d_v


def flat_documents(documents: Documents | None) -> tuple[list[int], list[int]]:
    """Document lengths as the ops take them: all in one list, and the count per batch element."""
    if documents is None:
        return [], []
    return [n for row in documents for n in row], [len(row) for row in documents]


def _documents(lengths: list[int], counts: list[int]) -> Documents | None:
    """The inverse of :func:`flat_documents`."""
    if not counts:
        return None
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return tuple(tuple(lengths[a:b]) for a, b in zip(starts, starts[1:]))


def _plan(q: Tensor, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
          scale: float, kernel: str, block_elements: int | None, document_lengths: list[int],
          documents_per_row: list[int]) -> AttentionPlan:
    """The cached plan of a one-device call on ``q`` ``(batch, seq, heads, dim)``."""
    return plan_attention(
        DilatedPattern(tuple(segment_lengths), tuple(dilation_rates)), tuple(q.shape), q.dtype,
        q.device, causal=causal, scale=scale, kernel=kernel, block_elements=block_elements,
        documents=_documents(document_lengths, documents_per_row),
    )


@torch.library.custom_op("longnet::dilated_attention", mutates_args=())
def dilated_attention_op(
    q: Tensor, k: Tensor, v: Tensor, segment_lengths: list[int], dilation_rates: list[int],
    causal: bool, scale: float, kernel: str, block_elements: int | None,
    document_lengths: list[int], documents_per_row: list[int],
) -> tuple[Tensor, Tensor]:
    """``out`` ``(batch, seq, heads, dim)`` and ``lse`` ``(batch, heads, seq)`` (accumulation
    dtype); ``dilated_attention``'s one-device arguments, documents by :func:`flat_documents`."""
    plan = _plan(q, segment_lengths, dilation_rates, causal, scale, kernel, block_elements,
                 document_lengths, documents_per_row)
    out, lse = attend(q, k, v, plan, None)
    return out, rearrange(lse, "b n h 1 -> b h n").contiguous()


@dilated_attention_op.register_fake
def _dilated_attention_fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    batch, seq, heads, _ = q.shape
    lse = q.new_empty((batch, heads, seq), dtype=accumulation_dtype(q.dtype))
    return q.new_empty(q.shape), lse


@torch.library.custom_op("longnet::dilated_attention_backward", mutates_args=())
def dilated_attention_backward_op(
    d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, segment_lengths: list[int], dilation_rates: list[int], causal: bool,
    scale: float, kernel: str, block_elements: int | None, document_lengths: list[int],
    documents_per_row: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of ``longnet::dilated_attention`` given its inputs, outputs and their
    gradients (``d_lse`` ``(batch, heads, seq)`` or None)."""
    plan = _plan(q, segment_lengths, dilation_rates, causal, scale, kernel, block_elements,
                 document_lengths, documents_per_row)
    lse = rearrange(lse, "b h n -> b n h 1").contiguous()
    if d_lse is not None:
        d_lse = rearrange(d_lse, "b h n -> b n h 1")
    return attend_backward(d_out, d_lse, (q, k, v, out, lse), plan, None)


@dilated_attention_backward_op.register_fake
def _dilated_attention_backward_fake(d_out: Tensor, d_lse: Tensor | None, q: Tensor,
                                     *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *call = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.call = call
    ctx.set_materialize_grads(False)  # no gradient into lse: the fused kernels' backward


def _backward(ctx: Any, d_out: Tensor | None, d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(out)
    grads = dilated_attention_backward_op(d_out, d_lse, q, k, v, out, lse, *ctx.call)
    return (*grads, *(None for _ in ctx.call))


dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
