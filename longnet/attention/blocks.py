"""Running block kernels on gathered blocks and folding their results into accumulators.

Accumulators use the sequence layout: ``out`` and gradients ``(batch, seq, heads, dim)``,
``lse`` ``(batch, seq, heads, 1)``, all in the accumulation dtype (see ``kernels``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.kernels import (
    accumulation_dtype,
    math_backward,
    math_forward,
    select_kernels,
)
from longnet.attention.layout import BlockGroup, gather, gathers_view, scatter_
from longnet.attention.merge import lse_merge_

CHUNK_ELEMENTS = 2**18
"""Upper bound on the elements of one gathered tensor (bounds the working memory)."""


def accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed ``out`` and ``-inf`` ``lse`` accumulators for ``q`` ``(batch, seq, heads, dim)``."""
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=acc)
    return out, lse


def branch_chunks(
    branches: Sequence[Sequence[BlockGroup]], row_elements: int, skip_first: bool
) -> Iterator[tuple[int, BlockGroup]]:
    """``(branch index, chunk)`` in the order they run: every group of every branch (but the
    first with ``skip_first``) split into chunks of at most ``CHUNK_ELEMENTS`` elements
    (``row_elements`` = batch * head_dim)."""
    for index in range(int(skip_first), len(branches)):
        for group in branches[index]:
            for chunk in group.chunks(CHUNK_ELEMENTS, row_elements):
                yield index, chunk


def merge_into_(
    out: Tensor, lse: Tensor, group: BlockGroup, block_out: Tensor, block_lse: Tensor, fresh: bool
) -> None:
    """Fold a block result ``(batch', heads, rows, dim)`` / ``(batch', heads, rows)`` into the
    accumulators at the rows of ``group``; ``fresh``: nothing was written there yet (copy)."""
    if fresh:
        scatter_(out, group, block_out)
        scatter_(lse, group, block_lse[..., None])
        return
    acc_out, acc_lse = gather(out, group), gather(lse, group)[..., 0]
    lse_merge_(acc_out, acc_lse, block_out, block_lse)
    write_back_(out, lse, group, acc_out, acc_lse)


def write_back_(
    out: Tensor, lse: Tensor, group: BlockGroup, acc_out: Tensor, acc_lse: Tensor
) -> None:
    """Store ``acc_out``/``acc_lse`` (``gather(out, group)``, ``gather(lse, group)[..., 0]``,
    merged in place) into the accumulators, unless those gathers were views of them."""
    if not gathers_view(group, *out.shape[:2]):
        scatter_(out, group, acc_out)
        scatter_(lse, group, acc_lse[..., None])


def block_backward(
    d_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_lse: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the mixture gradient, given the GLOBAL ``out`` and ``lse`` rows of
    its queries (kernel layout). A gradient into ``lse`` shifts ``delta = rowsum(d_out * out)``
    by ``-d_lse``; only the math kernel takes ``delta`` directly, so it handles that case."""
    if d_lse is None:
        _, backward = select_kernels(q.device, q.dtype)
        return backward(d_out, q, k, v, out, lse, causal, scale)
    delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1) - d_lse
    return math_backward(d_out, q, k, v, out, lse, causal, scale, delta=delta)


def query_side(
    d_out: Tensor, q: Tensor, out: Tensor, lse: Tensor, d_lse: Tensor | None, group: BlockGroup
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The backward's query-side blocks of ``group``: ``d_out, q, out, lse, d_lse``."""
    return (
        gather(d_out, group),
        gather(q, group),
        gather(out, group),
        gather(lse, group)[..., 0].contiguous(),
        None if d_lse is None else gather(d_lse, group)[..., 0],
    )


def adopted_branch(
    branches: Sequence[Sequence[BlockGroup]],
    seq_len: int,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> BlockGroup | None:
    """The first branch when ``attend_local`` adopts its kernel outputs as the accumulators: it
    is one group of plain views with rate 1 that covers every row of every head, the inputs
    are in the accumulation dtype, and the kernel is a fused one (the math kernel would hold
    a whole branch's scores at once)."""
    fused = select_kernels(device, dtype)[0] is not math_forward
    if not (fused and dtype == accumulation_dtype(dtype)) or not branches or len(branches[0]) != 1:
        return None
    (group,) = branches[0]
    covers = group.num_segments * group.segment_length == seq_len and len(group.heads) == num_heads
    return group if group.is_contiguous and covers else None


def _sequence_layout(block: Tensor, batch: int) -> Tensor:
    """Kernel-layout result ``(batch * segments, heads, rows[, dim])`` of a whole branch -> the
    accumulator layout ``(batch, seq, heads, dim)`` (or ``(batch, seq, heads, 1)`` for lse).
    A view when the kernel wrote sequence-major memory (ATen's CPU flash op does)."""
    if block.dim() == 3:
        block = block[..., None]
    return rearrange(block, "(b n) h w d -> b (n w) h d", b=batch).contiguous()


def attend_local(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    branches: Sequence[Sequence[BlockGroup]],
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``out, lse`` accumulators holding the attention of every block of every branch.

    With an ``adopted_branch``, the first branch runs as one kernel call whose outputs become
    the accumulators; otherwise it is copied in chunk by chunk (it covers each row and head at
    most once). Every further block is merged by log-sum-exp."""
    forward, _ = select_kernels(q.device, q.dtype)
    adopted = adopted_branch(branches, *q.shape[1:3], q.dtype, q.device)
    if adopted is None:
        out, lse = accumulators(q)
    else:
        block_out, block_lse = forward(
            gather(q, adopted), gather(k, adopted), gather(v, adopted), causal, scale
        )
        out, lse = _sequence_layout(block_out, q.shape[0]), _sequence_layout(block_lse, q.shape[0])
    row_elements = q.shape[0] * q.shape[-1]
    for index, chunk in branch_chunks(branches, row_elements, skip_first=adopted is not None):
        block_out, block_lse = forward(
            gather(q, chunk), gather(k, chunk), gather(v, chunk), causal, scale
        )
        # the first branch is copied in (unless adopted), every later one merged
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
    branches: Sequence[Sequence[BlockGroup]],
    causal: bool,
    scale: float,
) -> list[Tensor]:
    """Gradient accumulators ``[dq, dk, dv]`` (accumulation dtype) of every block of every
    branch; like ``attend_local``, an ``adopted_branch``'s kernel outputs become them."""
    # a gradient into lse runs the math kernel chunk by chunk (see block_backward)
    adopted = adopted_branch(branches, *q.shape[1:3], q.dtype, q.device) if d_lse is None else None
    if adopted is None:
        grads = [torch.zeros(q.shape, dtype=lse.dtype, device=q.device) for _ in range(3)]
    else:
        d_out_b, q_b, out_b, lse_b, _ = query_side(d_out, q, out, lse, None, adopted)
        _, backward = select_kernels(q.device, q.dtype)
        block_grads = backward(
            d_out_b, q_b, gather(k, adopted), gather(v, adopted), out_b, lse_b, causal, scale
        )
        grads = [_sequence_layout(grad, q.shape[0]) for grad in block_grads]
        del block_grads
    row_elements = q.shape[0] * q.shape[-1]
    for _, chunk in branch_chunks(branches, row_elements, skip_first=adopted is not None):
        d_out_b, q_b, out_b, lse_b, d_lse_b = query_side(d_out, q, out, lse, d_lse, chunk)
        block_grads = block_backward(
            d_out_b, q_b, gather(k, chunk), gather(v, chunk), out_b, lse_b, d_lse_b, causal, scale
        )
        del d_out_b, q_b, out_b, lse_b, d_lse_b
        for grad, block_grad in zip(grads, block_grads):
            scatter_(grad, chunk, block_grad, accumulate=True)
        del block_grads  # free before the next chunk's gathers and kernel call
    return grads
