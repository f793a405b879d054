"""The accumulators of a call and the log-sum-exp merge that folds block results into them.

Accumulators use the sequence layout: ``out`` and gradients ``(batch, seq, heads, dim)``,
``lse`` ``(batch, seq, heads, 1)``, all in the accumulation dtype (``kernels.accumulation_dtype``).
Blocks use the kernel layout ``(batch * segments, heads, rows, dim)`` (docs/architecture.md §3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from longnet.attention.blocks import Blocks, gather, scatter_
from longnet.attention.kernels import BlockBackward, accumulation_dtype

MERGE_TEMPORARIES = 3
"""lse-sized temporaries alive at once in :func:`lse_merge_` (the difference of the two lse,
its NaN-free copy, the sigmoid weight); ``lerp_`` and ``logaddexp`` then write in place."""


def lse_merge_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold attention over key set B into attention over key set A, in place in ``out_a, lse_a``.

    Args:
        out_a, out_b: ``(..., length, dim)`` normalised outputs of each part.
        lse_a, lse_b: ``(..., length)`` log-sum-exp of each part's scores (``-inf``: no keys;
            ``out_a`` must then be 0 there, as fresh accumulators are).
    The union's output is ``out_a + w (out_b - out_a)`` with ``w = exp(lse_b - lse_union)
    = sigmoid(lse_b - lse_a)`` (the two weights sum to 1): one pass over the outputs. A side
    with no keys (``lse_b = -inf``) gets ``w = 0``, also when the other side has none either
    (``-inf - -inf``): ``out = 0``, ``lse = -inf``, no NaN. A NaN on either side stays NaN.
    """
    weight = torch.sigmoid((lse_b - lse_a).masked_fill(torch.isneginf(lse_b), float("-inf")))
    out_a.lerp_(out_b.to(out_a.dtype), weight[..., None].to(out_a.dtype))
    torch.logaddexp(lse_a, lse_b, out=lse_a)


def accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed ``out`` and ``-inf`` ``lse`` accumulators for ``q`` ``(batch, seq, heads, dim)``."""
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=acc)
    return out, lse


class QueryRows(NamedTuple):
    """The accumulator rows of one block group's (or stack's) queries, gathered into the
    kernel layout: ``out`` ``(batch * segments, heads, rows, dim)`` and ``lse`` ``(batch *
    segments, heads, rows)``. Views of the accumulators when ``gathers_view``, else copies:
    merge into them in place, then ``write_back_``."""

    group: Blocks
    out: Tensor
    lse: Tensor

    @classmethod
    def gather(cls, out: Tensor, lse: Tensor, group: Blocks) -> QueryRows:
        return cls(group, gather(out, group), gather(lse, group)[..., 0])

    def write_back_(self, out: Tensor, lse: Tensor) -> None:
        """Store the merged rows into the accumulators, unless they are views of them (the
        gather returned memory of ``out`` itself)."""
        if self.out.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            scatter_(out, self.group, self.out)
            scatter_(lse, self.group, self.lse[..., None])


def merge_into_(
    out: Tensor, lse: Tensor, group: Blocks, block_out: Tensor, block_lse: Tensor, fresh: bool
) -> None:
    """Fold a block result ``(batch', heads, rows, dim)`` / ``(batch', heads, rows)`` into the
    accumulators at the rows of ``group``; ``fresh``: nothing was written there yet (copy)."""
    if fresh:
        scatter_(out, group, block_out)
        scatter_(lse, group, block_lse[..., None])
        return
    rows = QueryRows.gather(out, lse, group)
    lse_merge_(rows.out, rows.lse, block_out, block_lse)
    rows.write_back_(out, lse)


class BackwardQueries(NamedTuple):
    """What the backward needs of one block group's (or stack's) queries (kernel layout): the
    upstream gradient, the queries, and the GLOBAL merged ``out``/``lse`` (and ``d_lse``, the
    gradient into lse, or None) of their rows."""

    d_out: Tensor
    q: Tensor
    out: Tensor
    lse: Tensor
    d_lse: Tensor | None

    @classmethod
    def gather(
        cls, d_out: Tensor, q: Tensor, out: Tensor, lse: Tensor, d_lse: Tensor | None,
        group: Blocks,
    ) -> BackwardQueries:
        return cls(
            gather(d_out, group),
            gather(q, group),
            gather(out, group),
            gather(lse, group)[..., 0].contiguous(),
            None if d_lse is None else gather(d_lse, group)[..., 0],
        )

    def block(self, k: Tensor, v: Tensor) -> BlockBackward:
        """The kernel backward's inputs for these queries against the keys ``k``, ``v``."""
        return BlockBackward(self.d_out, self.q, k, v, self.out, self.lse)
