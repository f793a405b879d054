"""Running block kernels on gathered blocks and folding their results into accumulators.

Accumulators use the sequence layout: ``out`` and gradients ``(batch, seq, heads, dim)``,
``lse`` ``(batch, seq, heads, 1)``, all in the accumulation dtype (see ``kernels``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor

from longnet.attention.kernels import accumulation_dtype, math_backward, select_kernels
from longnet.attention.layout import BlockGroup, gather, scatter_
from longnet.attention.merge import lse_merge_

CHUNK_ELEMENTS = 2**18
"""Upper bound on the elements of one gathered tensor (bounds the working memory)."""


def accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed ``out`` and ``-inf`` ``lse`` accumulators for ``q`` ``(batch, seq, heads, dim)``."""
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=acc)
    return out, lse


def _branch_chunks(
    branches: Sequence[Sequence[BlockGroup]], q: Tensor
) -> Iterator[tuple[int, BlockGroup]]:
    """``(branch index, chunk)``: every group split into pieces of at most ``CHUNK_ELEMENTS``."""
    for index, groups in enumerate(branches):
        for group in groups:
            for chunk in group.chunks(CHUNK_ELEMENTS, q.shape[0] * q.shape[-1]):
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
    if not group.is_contiguous:  # gathered copies, not views: write them back
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


def attend_local_(
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    branches: Sequence[Sequence[BlockGroup]],
    causal: bool,
    scale: float,
) -> None:
    """Merge the attention of every block of every branch into fresh ``out``/``lse``
    accumulators (in place). The first branch covers each (row, head) at most once, so it
    is copied in rather than merged."""
    forward, _ = select_kernels(q.device, q.dtype)
    for index, chunk in _branch_chunks(branches, q):
        block_out, block_lse = forward(
            gather(q, chunk), gather(k, chunk), gather(v, chunk), causal, scale
        )
        merge_into_(out, lse, chunk, block_out, block_lse, fresh=index == 0)


def attend_local_backward_(
    grads: Sequence[Tensor],
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
) -> None:
    """Add the gradients of every block of every branch into ``grads = (dq, dk, dv)``."""
    for _, chunk in _branch_chunks(branches, q):
        d_out_b, q_b, out_b, lse_b, d_lse_b = query_side(d_out, q, out, lse, d_lse, chunk)
        block_grads = block_backward(
            d_out_b, q_b, gather(k, chunk), gather(v, chunk), out_b, lse_b, d_lse_b, causal, scale
        )
        for grad, block_grad in zip(grads, block_grads):
            scatter_(grad, chunk, block_grad, accumulate=True)
