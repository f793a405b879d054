"""The plan of a call: every decision made before a tensor is touched, made once per signature.

:func:`plan_attention` turns the arguments of ``dilated_attention`` into an
:class:`AttentionPlan`: the kernel (``kernels.select_kernel``), the block budget
(:func:`default_block_elements`), the local branches' block groups cut into chunks that fit the
budget, the branch adopted as the accumulators, and the pieces of branches whose segments span
ranks (``spanning``); with packed documents, the documents' block groups, stacked into few
kernel calls (``documents``), or cut at shard boundaries across ranks (``spanning``). The
forward and the backward read the same plan (docs/architecture.md §3); ``op.py`` and
``ring.py`` execute it.

Every function here depends only on hashable arguments (no tensor, no process group), so plans
are cached: a model calls attention with one signature per layer and step, and gets the same
plan object each time.
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
"""Block budget on the CPU, in elements of one gathered tensor. It bounds the working memory
(a few such tensors are alive at once) and is large enough that a chunk holds several heads:
the CPU flash backward parallelises over batch x heads only, so chunks of one head leave a
core idle."""

CUDA_WORKING_TENSORS = 16
"""How many block-sized float32 tensors the budget on CUDA leaves room for in the free device
memory (the backward's gathered inputs, gradients and the kernel's float32 accumulators)."""

PLAN_CACHE_SIZE = 256
"""Plans kept (least recently used dropped): one per signature (shapes, pattern, options,
rank, documents) a process calls with."""


@functools.cache
def default_block_elements(device: torch.device) -> int:
    """The block budget for ``device``, fixed for the process at its first use:
    ``CPU_BLOCK_ELEMENTS`` on the CPU; on CUDA the device memory free at that moment (counting
    memory the caching allocator holds unused) over ``CUDA_WORKING_TENSORS`` float32 tensors,
    so that a branch usually runs as one call. Fixed, because the budget decides the chunking
    and so the order of the merge: reading it per call would make results depend on the
    allocator's state. Pass ``dilated_attention(block_elements=...)`` to choose it."""
    if device.type != "cuda":
        return CPU_BLOCK_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(CPU_BLOCK_ELEMENTS, free // (CUDA_WORKING_TENSORS * 4))


@dataclass(frozen=True)
class AttentionPlan:
    """How one call runs, on this rank.

    ``adopted``: the first local branch when its kernel outputs become the accumulators (see
    ``adopted_branch``); ``chunks``: ``(branch index, chunk)`` of the remaining local work in
    the order it runs, each chunk (a group or, with packed documents, a stack of groups) one
    kernel call of at most ``block_elements`` elements; ``pieces``: the pieces of branches
    spanning ranks, run after the local work, in sets exchanged together (``ring.py``: one
    member each, or this rank's two chunks with ``zigzag``).
    """

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
    """The plan of a call on ``q`` of ``shape`` ``(batch, seq, heads, head_dim)``: this rank's
    shard when ``world_size > 1`` (group rank ``rank``, sharded by ``layout``, one of
    ``longnet.distributed.layouts.LAYOUTS``; ``transports``: one per branch); ``documents``:
    the document lengths of each batch element's whole sequence (contiguous layout only), or
    None for one document per batch element. Cached: equal arguments give the same object."""
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
    """The first branch when its kernel outputs become the accumulators: it is one group of
    plain views with rate 1 that covers every row of every head, the inputs are in the
    accumulation dtype, and the kernel is fused (the math kernel would hold a whole branch's
    scores at once)."""
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
    """``(branch index, chunk)`` in the order they run: every group of every branch (but the
    first with ``skip_first``) split into chunks of at most ``block_elements`` elements
    (``row_elements`` = batch * head_dim)."""
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
