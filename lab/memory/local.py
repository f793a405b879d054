"""Memory of the branches whose segments lie on one rank (``attention/op.py``): the chunks
of the plan, one at a time, above the accumulators."""

from __future__ import annotations

from dataclasses import replace

from lab.memory.setup import MERGE_TEMPORARIES, AttentionSetup
from lab.memory.workspace import kernel_workspace_backward, kernel_workspace_forward
from longnet.attention.blocks import BlockGroup, gathers_view


def local_chunks(setup: AttentionSetup) -> list[tuple[int, BlockGroup]]:
    """``(branch index, chunk)``: one chunk of every shape among those of the chunked local
    branches (``plan.branch_chunks``, which ``local.attend_local`` runs one at a time). Chunks
    of one shape take the same memory, so the workspace is that of these few, whatever the
    number of segments (:func:`chunk_shapes`)."""
    skip = setup.adopted is not None
    return [
        (index, chunk)
        for index in range(int(skip), len(setup.local_branches))
        for group in setup.local_branches[index]
        for chunk in chunk_shapes(group, setup.block_elements, setup.row_elements)
    ]


def chunk_shapes(group: BlockGroup, max_elements: int, row_elements: int) -> list[BlockGroup]:
    """One chunk of each shape that ``group.chunks(max_elements, row_elements)`` yields: per
    range of heads, its first chunk (as many segments as fit) and, when the segments do not
    split evenly, a chunk of the remaining segments (the last one; its start aside)."""
    shapes = []
    for heads in replace(group, num_segments=1).chunks(max_elements, row_elements):
        first = next(replace(heads, num_segments=group.num_segments).chunks(
            max_elements, row_elements))
        shapes.append(first)
        if rest := group.num_segments % first.num_segments:
            shapes.append(replace(first, num_segments=rest))
    return shapes


def chunk_elements(setup: AttentionSetup, chunk: BlockGroup) -> int:
    """Elements of one gathered chunk tensor ``(batch * segments, heads, rows, head_dim)``."""
    return setup.batch * chunk.num_segments * len(chunk.heads) * chunk.rows * setup.head_dim


def gathers_copy(setup: AttentionSetup, chunk: BlockGroup) -> bool:
    """Whether ``blocks.gather`` of ``chunk`` copies (see ``blocks.gathers_view``)."""
    return not gathers_view(chunk, setup.batch, setup.shard_len)


def _lse_part(setup: AttentionSetup, elements: int) -> int:
    """Bytes of an lse-shaped tensor that goes with a block of ``elements`` elements."""
    return elements // setup.head_dim * setup.acc_size


def local_forward_workspace(setup: AttentionSetup) -> int:
    """Peak bytes of the local branches' forward above the accumulators.

    The adopted branch (``setup.adopted``) writes the accumulators itself: only the kernel
    workspace. Per chunk of ``C`` elements (``[copy]``: ``gathers_copy``): kernel phase =
    gathered q, k, v ``3 C s [copy]`` + output ``C s + lse`` + kernel workspace; merge phase =
    output ``C s + lse`` + (unless the first branch, which is copied) gathered accumulator
    rows ``(C a + lse) [copy]`` + ``MERGE_TEMPORARIES`` lse temporaries. A chunk's output is
    freed before the next call.
    """
    s, peak = setup.input_size, 0
    adopted = setup.adopted
    if adopted is not None:
        peak = kernel_workspace_forward(setup, adopted.rows, adopted.rows)
    for index, chunk in local_chunks(setup):
        c = chunk_elements(setup, chunk)
        copies = gathers_copy(setup, chunk)
        block = c * s + _lse_part(setup, c)
        kernel = 3 * c * s * copies + block
        kernel += kernel_workspace_forward(setup, chunk.rows, chunk.rows)
        merge = block
        if index > 0:
            merge += (c * setup.acc_size + _lse_part(setup, c)) * copies
            merge += MERGE_TEMPORARIES * _lse_part(setup, c)
        peak = max(peak, kernel, merge)
    return peak


def local_backward_workspace(setup: AttentionSetup) -> int:
    """Peak bytes of the local branches' backward above saved tensors and gradient buffers.

    The adopted branch (``setup.adopted``) writes the gradient buffers itself: a contiguous
    lse copy + the kernel workspace. Per chunk of ``C`` elements: query side
    ``qs = 3 C s [copy] + lse`` (d_out, q, out rows and a contiguous lse copy); query phase =
    ``qs`` + the gathered lse ``[copy]``; kernel phase = ``qs`` + gathered k, v
    ``2 C s [copy]`` + gradients ``3 C s`` + kernel workspace (+ ``C s`` when a contiguous
    chunk was copied by ``reshape``: the CPU kernel makes one of those head-major blocks
    sequence-major again). Scatter-adds are in place; a chunk's blocks are freed before the
    next chunk's gathers.
    """
    s, peak = setup.input_size, 0
    adopted = setup.adopted
    if adopted is not None:
        lse = setup.lse_elements * setup.acc_size
        peak = lse + kernel_workspace_backward(setup, adopted.rows, adopted.rows)
    for _, chunk in local_chunks(setup):
        c = chunk_elements(setup, chunk)
        copies = gathers_copy(setup, chunk)
        query = 3 * c * s * copies + _lse_part(setup, c)
        query_phase = query + _lse_part(setup, c) * copies
        kernel = query + 2 * c * s * copies + 3 * c * s
        kernel += kernel_workspace_backward(setup, chunk.rows, chunk.rows)
        kernel += c * s * (copies and chunk.is_contiguous)  # kernel re-lays a head-major copy
        peak = max(peak, query_phase, kernel)
    return peak


