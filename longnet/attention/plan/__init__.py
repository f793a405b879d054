"""The plan of a call: every decision made before a tensor is touched, made once per signature
(:func:`plan_attention`, cached: it takes only hashable arguments). The forward and the backward
read the same plan (docs/architecture.md §3); ``op.py`` and ``ring.py`` execute it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longnet.attention.blocks import BlockGroup, Blocks, branch_groups
from longnet.attention.documents import Documents, document_branches, stacked_chunks
from longnet.attention.kernels import Kernel, accumulation_dtype, select_kernel
from longnet.attention.pattern import DilatedPattern
from longnet.attention.plan.spanning import (
    SpanningPiece,
    plan_document_ring,
    plan_sequence_parallel,
)

CPU_BLOCK_ELEMENTS = 2**18
"""Block budget on the CPU, in elements of one gathered tensor: bounds working memory, yet
holds several heads (the CPU flash backward parallelises over batch x heads only)."""

CUDA_WORKING_TENSORS = 16
"""Block-sized float32 tensors the CUDA budget leaves room for in the free device memory."""

PLAN_CACHE_SIZE = 256
"""Plans kept (least recently used dropped), one per call signature."""


@functools.cache
def default_block_elements(device: torch.device) -> int:
    """The block budget for ``device``: ``CPU_BLOCK_ELEMENTS``, or on CUDA the free memory
    (with the allocator's unused cache) over ``CUDA_WORKING_TENSORS`` float32 tensors. Fixed
    at first use: the budget decides the chunking, hence the merge order and the results."""
    if device.type != "cuda":
        return CPU_BLOCK_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(CPU_BLOCK_ELEMENTS, free // (CUDA_WORKING_TENSORS * 4))


@dataclass(frozen=True)
class AttentionPlan:
    """How one call runs, on this rank: ``adopted``, the first branch when its kernel outputs
    become the accumulators; ``chunks``, ``(branch index, chunk)`` of the other local work in
    order, one kernel call each; ``pieces``, the spanning pieces, in sets exchanged together."""

    kernel: Kernel
    causal: bool
    scale: float
    block_elements: int
    adopted: BlockGroup | None
    chunks: tuple[tuple[int, Blocks], ...]
    pieces: tuple[tuple[SpanningPiece, ...], ...]


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_attention(
    pattern: DilatedPattern,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    causal: bool,
    scale: float,
    world_size: int = 1,
    rank: int = 0,
    layout: str = "contiguous",
    transports: tuple[str, ...] = (),
    kernel: str = "auto",
    block_elements: int | None = None,
    documents: Documents | None = None,
) -> AttentionPlan:
    """The (cached) plan of a call on ``q`` of ``shape`` ``(batch, seq, heads, head_dim)``,
    this rank's shard when ``world_size > 1``; ``transports``: one per branch; ``documents``:
    each batch element's document lengths over the whole sequence, or None."""
    batch, seq_len, heads, head_dim = shape
    chosen = select_kernel(device, dtype, head_dim, kernel)
    budget = default_block_elements(device) if block_elements is None else block_elements
    if documents is not None and any(len(lengths) > 1 for lengths in documents):
        if world_size == 1:
            local, pieces = document_branches(pattern, documents, heads), []
        else:
            local, pieces = plan_document_ring(
                pattern, documents, seq_len, rank, heads, transports, head_dim, budget,
            )
        chunks = tuple(
            (index, chunk) for index, groups in enumerate(local)
            for chunk in stacked_chunks(groups, batch, head_dim, budget)
        )
        return AttentionPlan(chosen, causal, scale, budget, None, chunks, tuple(pieces))
    if world_size == 1:
        local = [branch_groups(seq_len, heads, w, r) for w, r in pattern.branches]
        pieces = []
    else:
        local, pieces = plan_sequence_parallel(
            pattern, seq_len, world_size, rank, heads, transports, batch * head_dim, budget,
            layout,
        )
    adopted = adopted_branch(local, seq_len, heads, dtype, chosen)
    chunks = tuple(branch_chunks(local, batch * head_dim, budget, adopted is not None))
    return AttentionPlan(chosen, causal, scale, budget, adopted, chunks, tuple(pieces))


def adopted_branch(
    branches: Sequence[Sequence[BlockGroup]],
    seq_len: int,
    num_heads: int,
    dtype: torch.dtype,
    kernel: Kernel,
) -> BlockGroup | None:
    """The first branch when its kernel outputs can be the accumulators: one contiguous group
    covering every row and head, inputs in the accumulation dtype, a fused kernel."""
    if not (kernel.fused and dtype == accumulation_dtype(dtype)) or not branches:
        return None
    if len(branches[0]) != 1:
        return None
    (group,) = branches[0]
    covers = group.num_segments * group.segment_length == seq_len and len(group.heads) == num_heads
    return group if group.is_contiguous and covers else None


def branch_chunks(
    branches: Sequence[Sequence[BlockGroup]], row_elements: int, block_elements: int,
    skip_first: bool,
) -> list[tuple[int, BlockGroup]]:
    """``(branch index, chunk)`` in run order: every group (not the first branch's with
    ``skip_first``) cut into chunks of at most ``block_elements`` elements."""
    return [
        (index, chunk)
        for index in range(int(skip_first), len(branches))
        for group in branches[index]
        for chunk in group.chunks(block_elements, row_elements)
    ]


__all__ = [
    "CPU_BLOCK_ELEMENTS",
    "AttentionPlan",
    "Documents",
    "SpanningPiece",
    "adopted_branch",
    "branch_chunks",
    "default_block_elements",
    "plan_attention",
]
