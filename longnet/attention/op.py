"""``longnet::dilated_attention``: dilated attention on one device as a PyTorch custom op.

``torch.library.custom_op`` ops with fake (meta) implementations, so that ``torch.compile``
traces through them without a graph break (docs/architecture.md §3, "One op"):

- ``longnet::dilated_attention(q, k, v, ...) -> (out, lse)``;
- ``longnet::dilated_attention_backward(d_out, d_lse, q, k, v, out, lse, ...) -> (dq, dk, dv)``,
  its gradient (``register_autograd``).

Both take the call as plain values (segment lengths and rates, ``causal``, ``scale``, the
kernel name, the block budget, packed documents as flat lengths), rebuild the cached plan from
them and run the shared executors (``execute.attend``/``attend_backward``). Sequence-parallel
calls do not come here: they run the autograd function of ``dilated``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.execute import attend, attend_backward
from longnet.attention.kernels import accumulation_dtype
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan import AttentionPlan, Documents, plan_attention


def flat_documents(documents: Documents | None) -> tuple[list[int], list[int]]:
    """Document lengths as the ops take them: every batch element's lengths in one list, and
    how many documents each batch element holds (two empty lists: no packed documents)."""
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
    """``out`` ``(batch, seq, heads, dim)`` in the input dtype and ``lse`` ``(batch, heads,
    seq)`` in the accumulation dtype (float64 for float64 inputs, else float32) of ``q, k, v``
    ``(batch, seq, heads, dim)``; the arguments of ``dilated_attention`` on one device, with
    packed documents as :func:`flat_documents` gives them."""
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
    """``dq, dk, dv`` ``(batch, seq, heads, dim)`` of ``longnet::dilated_attention`` given its
    inputs, its outputs ``out``/``lse`` and their upstream gradients (``d_lse`` ``(batch,
    heads, seq)`` or None: none flows into ``lse``)."""
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
