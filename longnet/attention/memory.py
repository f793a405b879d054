"""A memory model of ``dilated_attention``: per-rank bytes and traffic of one forward + backward.

A model, not run-time code: the library never imports it. Its numbers are formulas over the
shapes the implementation allocates (``dilated.py``, ``blocks.py``, ``layout.py``, ``ring.py``,
the CPU flash kernel), not measurements; ``scripts/plan_context.py``, ``scripts/bench_ring.py``
and ``tests/unit/test_memory_plan.py`` use them. Which branches are local, the block groups and
their chunks, the segment groups, the heads per piece and who computes with whose block come
from the planner's own functions (``ring``, ``blocks``, ``layout``); this module adds the
accounting. All sizes are in **bytes** per rank unless a name says otherwise; "elements" are
tensor elements.

Usage::

    import torch
    from longnet.attention import DilatedPattern
    from longnet.attention.memory import AttentionSetup, plan_memory

    setup = AttentionSetup(batch=1, seq_len=32768, world_size=4, num_heads=8, head_dim=64,
                           dtype=torch.float32, pattern=DilatedPattern.geometric(5),
                           causal=True, transport="ring")
    plan = plan_memory(setup)
    plan.peak_bytes            # worst rank: peak bytes above q, k, v and the upstream gradient
    plan.ranks[0].sent_forward_bytes

Notation (per rank): ``L = N / P`` shard length, ``E = batch * L * heads * head_dim`` elements of
one shard tensor, ``s`` the input element size, ``a`` the accumulator element size (4 for
fp32/bf16/fp16 inputs, 8 for fp64). A branch ``(w, r)`` spanning ``g`` ranks runs as pieces of
a few heads each (``ring.heads_per_piece``); a piece packs this rank's selected K and V rows of
its heads into one message of ``M = 2 * batch * heads_per_piece * R * head_dim`` elements
(``R = ceil(L / r)``, ``message_rows``).

Each phase's peak is the sum of the tensors alive in it: the persistent tensors
(``persistent_bytes``: saved ``out``/``lse``, accumulators, gradient buffers), the local
branches' chunks (``local_forward_workspace``, ``local_backward_workspace``), and per spanning
branch, one piece at a time, its messages, dK/dV buffers and block work
(``spanning_branch_memory``). Communication: payload bytes of the point-to-point sends
(``batch_isend_irecv``); the 16-byte argument check (``all_reduce``) of each call is not counted.

Checked against measured peaks: the single-device peak RSS of one forward + backward (B1 H8 D64,
causal, patterns up to (32768, 16), float32/float64/bfloat16, batch 1 and 2) came out within 2%
of the formula in repeated runs (-1.9% to +1.5%: the rest of the process and allocator noise);
``scripts/bench_ring.py`` compares every rank's peak with it. With drifting offsets the spanning
block workspace is an upper bound (all heads of a piece in one block of ``ceil(L / r)`` rows).
For bfloat16 the CPU kernel's own reduced-precision packing buffers are not modelled (a large
dense ring block's forward peak came out 19% low; the backward peak, which dominates, within
4%). Kernel workspaces are those of the CPU flash kernel; on other devices only those small
terms differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from longnet.attention import blocks
from longnet.attention.kernels import accumulation_dtype
from longnet.attention.layout import BlockGroup, gathers_view, selected_rows
from longnet.attention.pattern import DilatedPattern
from longnet.attention.ring import (
    Schedule,
    heads_per_piece,
    padded_length,
    plan_sequence_parallel,
    segment_group,
    transports_per_branch,
)

MERGE_TEMPORARIES = 4
"""lse-sized temporaries alive at once in ``merge.lse_merge_`` (lse, finite, x - finite, exp)."""

MODELLED_DEVICE = torch.device("cpu")
"""The device whose kernels are modelled (the CPU flash kernel, a fused one)."""


# -- setup ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSetup:
    """One ``dilated_attention`` call on a sequence-parallel group.

    ``seq_len`` is the total length ``N`` the group runs (a multiple of ``world_size`` that fits
    the pattern: see ``padded_length``); ``transport`` is one name or one per branch;
    ``threads`` is the intra-op thread count (the CPU kernel keeps one workspace per thread).
    Invalid setups raise the library's own errors (the planner's, for the pattern).
    """

    batch: int
    seq_len: int
    world_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    pattern: DilatedPattern
    causal: bool = True
    transport: str | tuple[str, ...] = "ring"
    threads: int = 1
    local_branches: list[list[BlockGroup]] = field(init=False, repr=False, compare=False)
    """The block groups of every local branch (``w <= L``), as the planner builds them (the
    same on every rank)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", DilatedPattern.coerce(self.pattern))
        for name in ("batch", "seq_len", "world_size", "num_heads", "head_dim", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"AttentionSetup: {name} must be a positive integer, got {value!r}."
                )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(
                f"AttentionSetup: dtype must be a floating torch.dtype, got {self.dtype!r}."
            )
        transports = self.transports
        if self.seq_len % self.world_size:
            fit = padded_length(self.seq_len, self.pattern, self.world_size)
            raise ValueError(
                f"dilated_attention: a sequence of {self.seq_len} tokens cannot be split into "
                f"{self.world_size} equal shards. Pad it to longnet.attention.padded_length("
                f"{self.seq_len}, pattern, {self.world_size}) = {fit} tokens."
            )
        local, _ = plan_sequence_parallel(
            self.pattern,
            self.shard_len,
            self.world_size,
            0,
            self.num_heads,
            transports,
            self.row_elements,
        )
        object.__setattr__(self, "local_branches", local)

    @property
    def transports(self) -> tuple[str, ...]:
        """One transport name per branch."""
        return transports_per_branch(self.transport, len(self.pattern.branches))

    @property
    def shard_len(self) -> int:
        """``L = N / P`` tokens per rank."""
        return self.seq_len // self.world_size

    @property
    def row_elements(self) -> int:
        """``batch * head_dim``: elements per row and head of a block."""
        return self.batch * self.head_dim

    @property
    def input_size(self) -> int:
        """``s``: bytes per input element."""
        return self.dtype.itemsize

    @property
    def acc_size(self) -> int:
        """``a``: bytes per accumulator element (``out``/``lse``/gradient accumulators)."""
        return accumulation_dtype(self.dtype).itemsize

    @property
    def shard_elements(self) -> int:
        """``E = batch * L * heads * head_dim``: elements of one shard tensor."""
        return self.batch * self.shard_len * self.num_heads * self.head_dim

    @property
    def lse_elements(self) -> int:
        """``batch * L * heads``: elements of one shard's lse."""
        return self.batch * self.shard_len * self.num_heads


# -- kernel workspace -------------------------------------------------------------------------


def _flash_splits(q_len: int, k_len: int) -> tuple[int, int]:
    """Query / key block sizes of ATen's CPU flash attention for these lengths."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, k_len)


def kernel_workspace_forward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash forward's per-thread buffer (scores, max, sum, output row block)."""
    qs, ks = _flash_splits(q_len, k_len)
    return setup.threads * (qs * ks + 2 * qs + qs * setup.head_dim) * setup.acc_size


def kernel_workspace_backward(setup: AttentionSetup, q_len: int, k_len: int) -> int:
    """Bytes of the CPU flash backward's per-thread buffers (probabilities and their gradient)."""
    qs, ks = _flash_splits(q_len, k_len)
    return setup.threads * (2 * qs * ks + qs) * setup.acc_size


# -- local branches ---------------------------------------------------------------------------


def adopted_branch(setup: AttentionSetup) -> BlockGroup | None:
    """``blocks.adopted_branch`` of the local branches: the first one when ``attend_local`` runs
    it as one kernel call whose outputs become the accumulators."""
    local, heads = setup.local_branches, setup.num_heads
    return blocks.adopted_branch(local, setup.shard_len, heads, setup.dtype, MODELLED_DEVICE)


def local_chunks(setup: AttentionSetup) -> Iterator[tuple[int, BlockGroup]]:
    """``(branch index, chunk)`` of the chunked local branches, in the order
    ``blocks.attend_local`` runs them (``blocks.branch_chunks``)."""
    skip = adopted_branch(setup) is not None
    return blocks.branch_chunks(setup.local_branches, setup.row_elements, skip_first=skip)


def chunk_elements(setup: AttentionSetup, chunk: BlockGroup) -> int:
    """Elements of one gathered chunk tensor ``(batch * segments, heads, rows, head_dim)``."""
    return setup.batch * chunk.num_segments * len(chunk.heads) * chunk.rows * setup.head_dim


def gathers_copy(setup: AttentionSetup, chunk: BlockGroup) -> bool:
    """Whether ``layout.gather`` of ``chunk`` copies (see ``layout.gathers_view``)."""
    return not gathers_view(chunk, setup.batch, setup.shard_len)


def _lse_part(setup: AttentionSetup, elements: int) -> int:
    """Bytes of an lse-shaped tensor that goes with a block of ``elements`` elements."""
    return elements // setup.head_dim * setup.acc_size


def local_forward_workspace(setup: AttentionSetup) -> int:
    """Peak bytes of the local branches' forward above the accumulators.

    An ``adopted_branch`` writes the accumulators itself: only the kernel workspace. Per
    chunk of ``C`` elements (``[copy]``: ``gathers_copy``): kernel phase = gathered q, k, v
    ``3 C s [copy]`` + output ``C s + lse`` + kernel workspace; merge phase = output ``C s + lse``
    + (unless the first branch, which is copied) gathered accumulator rows ``(C a + lse) [copy]``
    + ``MERGE_TEMPORARIES`` lse temporaries. A chunk's output is freed before the next call.
    """
    s, peak = setup.input_size, 0
    adopted = adopted_branch(setup)
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

    An ``adopted_branch`` writes the gradient buffers itself: a contiguous lse copy + the
    kernel workspace. Per chunk of ``C`` elements: query side ``qs = 3 C s [copy] + lse``
    (d_out, q, out rows and a contiguous lse copy); query phase = ``qs`` + the gathered lse
    ``[copy]``; kernel phase = ``qs`` + gathered k, v ``2 C s [copy]`` + gradients ``3 C s`` +
    kernel workspace (+ ``C s`` when a contiguous chunk was copied by ``reshape``: the CPU
    kernel makes one of those head-major blocks sequence-major again). Scatter-adds are in
    place; a chunk's blocks are freed before the next chunk's gathers.
    """
    s, peak = setup.input_size, 0
    adopted = adopted_branch(setup)
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


# -- branches spanning ranks -----------------------------------------------------------------


@dataclass(frozen=True)
class SpanningBranchMemory:
    """One branch ``(w, r)`` spanning ranks, as seen from one rank (bytes unless noted)."""

    segment_length: int
    rate: int
    transport: str
    members: int  # g: ranks in this rank's segment group
    index: int  # this rank's place among them
    rows_max: int  # R: rows per head in the message
    heads_per_piece: int  # the branch runs as pieces of at most this many heads (one at a time)
    pieces: int
    message_bytes: int  # one piece's K/V message, (2, batch, heads, R, head_dim), input dtype
    kv_buffer_bytes: int  # peak of K/V message + receive buffers (ring) / all blocks (allgather)
    dkv_buffer_bytes: int  # peak of dK/dV accumulator + receive (ring) / partials, reduce buffers
    forward_bytes: int  # peak of this branch's forward above the accumulators
    backward_bytes: int  # peak of this branch's backward above saved tensors and gradients
    sent_forward_bytes: int
    sent_backward_bytes: int
    received_forward_bytes: int
    received_backward_bytes: int


def message_rows(setup: AttentionSetup, segment: int, rate: int, rank: int) -> int:
    """``R``: the most rows any member of ``rank``'s segment group selects for one head (the
    message's row dimension, ``SpanningPiece.rows_max`` of the whole branch). The group's first
    member starts the segment, so there head 0 selects rows ``0, r, ...``: ``R = ceil(L / r)``
    whatever the segment length and rank."""
    return selected_rows(setup.shard_len, 0, rate)


def _block_work(setup: AttentionSetup, rate: int, heads: int, rows: int) -> tuple[int, int]:
    """``(forward, backward)`` peak bytes of the block work of a spanning branch piece of
    ``heads`` heads: its query side, gathered once per call, and one query-block x key-block
    pair (``R = rows`` rows each).

    ``[copy]``: the query rows are copies when ``r > 1`` (views when ``r == 1``). K and V blocks
    are views of the message when ``r`` divides ``L`` (one head group per member), else copies
    by head index ``2 Ck s`` (and the dK/dV read-modify-write holds one ``Ck a`` more).
    Forward: query side q ``Cq s [copy]`` + accumulator rows ``(Cq a + lse) [copy]``; per block
    output ``Cq s + lse`` + the larger of kernel workspace and ``MERGE_TEMPORARIES`` lse.
    Backward: query side ``3 Cq s [copy] + lse`` + the dQ accumulator ``Cq a``; per block
    gradients ``Cq s + 2 Ck s`` + kernel workspace. The CPU kernel re-lays one head-major K
    or V block sequence-major (``Ck s``).
    """
    s, a = setup.input_size, setup.acc_size
    cq = ck = setup.batch * heads * setup.head_dim * rows
    copies = rate > 1
    kv_copies = setup.shard_len % rate != 0
    lse = _lse_part(setup, cq)
    relay = ck * s
    query_forward = cq * s * copies + (cq * a + lse) * copies
    workspace = max(kernel_workspace_forward(setup, rows, rows), MERGE_TEMPORARIES * lse)
    kv = 2 * ck * s * kv_copies
    forward = query_forward + kv + cq * s + lse + workspace + relay
    query_backward = 3 * cq * s * copies + lse + cq * a
    grads = cq * s + 2 * ck * s
    backward = query_backward + kv + grads + kernel_workspace_backward(setup, rows, rows)
    backward += max(relay, ck * a * kv_copies)
    return forward, backward


def _ring_transport(
    schedule: Schedule, message: int, accumulator: int, pack: int, work: tuple[int, int]
) -> tuple[int, int, int, int]:
    """``ring``: ``(kv_buffers, dkv_buffers, forward, backward)`` peak bytes.

    Message ``Ms`` and its receive buffer while a hop is in flight; right after a receive the
    previous message is still held by its finished send until the next hop is posted
    (``3 Ms`` when ``g >= 3``). Backward adds the travelling accumulator ``Ma`` and, while it
    moves, its receive buffer. ``pack``: peak while the message is packed.
    """
    if schedule.size == 1:
        in_flight = moment = message
    else:
        in_flight = 2 * message
        moment = 3 * message if schedule.size >= 3 else 2 * message
    forward = max(pack, moment, in_flight + work[0])
    dkv = accumulator if schedule.size == 1 else 2 * accumulator
    backward = max(
        pack,
        moment + accumulator,
        in_flight + accumulator + work[1],
        in_flight + dkv,
        message + accumulator + accumulator // 2,  # unpack: one half of the accumulator copied
    )
    return max(moment, in_flight), dkv, forward, backward


def _allgather_transport(
    schedule: Schedule, message: int, accumulator: int, pack: int, work: tuple[int, int]
) -> tuple[int, int, int, int]:
    """``allgather``: ``(kv_buffers, dkv_buffers, forward, backward)`` peak bytes.

    All ``g`` blocks ``g Ms`` stay alive; the backward keeps one ``Ma`` partial per attended
    source (``schedule.sources``), then ``reduce_to_owners`` adds the sum ``Ma`` and one
    receive buffer ``Ma`` per member that sends a partial for this block (``schedule.readers``).
    """
    attended = len(schedule.sources)
    blocks_bytes = schedule.size * message
    dkv = (attended + 1 + len(schedule.readers)) * accumulator
    forward = max(pack, blocks_bytes + work[0])
    backward = max(
        pack,
        blocks_bytes + attended * accumulator + work[1],
        blocks_bytes + dkv,
        blocks_bytes + (attended + 1) * accumulator + accumulator // 2,  # unpack
    )
    return blocks_bytes, dkv, forward, backward


def _traffic(
    schedule: Schedule, transport: str, message: int, accumulator: int
) -> tuple[int, int, int, int]:
    """``(sent fwd, sent bwd, received fwd, received bwd)`` payload bytes of one spanning branch.

    ``ring``: ``g - 1`` message hops each way, the accumulator ``g`` hops (it returns home).
    ``allgather``: the message to/from every other member each way; the backward sends a
    partial to every other member whose block it computed with and receives one from every
    member that computed with this rank's block (``schedule.readers``).
    """
    if schedule.size == 1:
        return 0, 0, 0, 0
    hops = (schedule.size - 1) * message
    if transport == "ring":
        travelled = hops + schedule.size * accumulator
        return hops, travelled, hops, travelled
    sends, receives = len(schedule.sources) - 1, len(schedule.readers)
    return hops, hops + sends * accumulator, hops, hops + receives * accumulator


def spanning_branch_memory(
    setup: AttentionSetup, segment: int, rate: int, transport: str, rank: int
) -> SpanningBranchMemory:
    """Memory and traffic of the branch ``(segment, rate)`` spanning ranks, on ``rank``.

    The branch runs piece by piece (``ring.heads_per_piece``: at most ``blocks.CHUNK_ELEMENTS``
    elements per message); memory is that of the largest piece, traffic the sum over pieces.
    """
    _, members = segment_group(rank, setup.shard_len, segment, setup.seq_len)
    schedule = Schedule(len(members), rank - members[0], setup.causal)
    rows = message_rows(setup, segment, rate, rank)
    per_piece = heads_per_piece(rows, setup.row_elements, setup.num_heads)
    message_elements = 2 * per_piece * rows * setup.row_elements
    message = message_elements * setup.input_size
    accumulator = message_elements * setup.acc_size
    work = _block_work(setup, rate, per_piece, rows)
    pack = message + (message // 2 if rate > 1 else 0)  # the message + one gathered K or V
    exchange = _ring_transport if transport == "ring" else _allgather_transport
    kv, dkv, forward, backward = exchange(schedule, message, accumulator, pack, work)
    # traffic of all pieces together: that of one message holding every head
    total = 2 * setup.num_heads * rows * setup.row_elements
    sent_f, sent_b, recv_f, recv_b = _traffic(
        schedule, transport, total * setup.input_size, total * setup.acc_size
    )
    return SpanningBranchMemory(
        segment_length=segment,
        rate=rate,
        transport=transport,
        members=schedule.size,
        index=schedule.index,
        rows_max=rows,
        heads_per_piece=per_piece,
        pieces=-(-setup.num_heads // per_piece),
        message_bytes=message,
        kv_buffer_bytes=kv,
        dkv_buffer_bytes=dkv,
        forward_bytes=forward,
        backward_bytes=backward,
        sent_forward_bytes=sent_f,
        sent_backward_bytes=sent_b,
        received_forward_bytes=recv_f,
        received_backward_bytes=recv_b,
    )


def spanning_branches(setup: AttentionSetup) -> list[tuple[int, int, str]]:
    """``(segment length capped at N, rate, transport)`` of every branch spanning ranks (its
    segment is longer than the shard)."""
    return [
        (min(w, setup.seq_len), r, t)
        for (w, r), t in zip(setup.pattern.branches, setup.transports)
        if setup.world_size > 1 and min(w, setup.seq_len) > setup.shard_len
    ]


# -- per rank ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank for one forward + backward call (above q, k, v and the upstream
    gradient, which the caller owns)."""

    rank: int
    saved_qkv_bytes: int  # q, k, v kept for backward (the inputs themselves: no extra memory)
    saved_out_bytes: int
    saved_lse_bytes: int
    grad_bytes: int  # dq, dk, dv accumulators (+ input-dtype casts when s != a)
    local_forward_bytes: int  # local chunk workspace, forward
    local_backward_bytes: int  # local chunk workspace, backward
    branches: tuple[SpanningBranchMemory, ...]
    forward_peak_bytes: int
    backward_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Peak extra bytes of the whole call (forward or backward, whichever is larger)."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def saved_bytes(self) -> int:
        """Activations kept from forward to backward that the call allocates (out, lse)."""
        return self.saved_out_bytes + self.saved_lse_bytes

    @property
    def message_bytes(self) -> int:
        """Largest packed K/V message of any spanning branch (0 without any)."""
        return max((b.message_bytes for b in self.branches), default=0)

    @property
    def kv_buffer_bytes(self) -> int:
        """Largest peak of K/V messages and receive buffers / all-gather blocks."""
        return max((b.kv_buffer_bytes for b in self.branches), default=0)

    @property
    def dkv_buffer_bytes(self) -> int:
        """Largest peak of travelling dK/dV accumulators / partials and reduce buffers."""
        return max((b.dkv_buffer_bytes for b in self.branches), default=0)

    @property
    def sent_forward_bytes(self) -> int:
        return sum(b.sent_forward_bytes for b in self.branches)

    @property
    def sent_backward_bytes(self) -> int:
        return sum(b.sent_backward_bytes for b in self.branches)

    @property
    def received_forward_bytes(self) -> int:
        return sum(b.received_forward_bytes for b in self.branches)

    @property
    def received_backward_bytes(self) -> int:
        return sum(b.received_backward_bytes for b in self.branches)


def persistent_bytes(setup: AttentionSetup) -> tuple[int, int, int, int]:
    """``(forward accumulators, saved out, saved lse, gradient buffers)`` in bytes.

    Forward: ``out`` (``E a``) and ``lse`` accumulators. Saved: ``out`` in the input dtype (the
    accumulator itself when ``s == a``) and the accumulator ``lse``. Backward: ``dq, dk, dv``
    accumulators ``3 E a``, cast to the input dtype at the end (``3 E s`` more when ``s != a``).
    """
    e, s, a = setup.shard_elements, setup.input_size, setup.acc_size
    lse = setup.lse_elements * a
    casts = 3 * e * s if s != a else 0
    return e * a + lse, e * s, lse, 3 * e * a + casts


def rank_memory(
    setup: AttentionSetup, rank: int, local: tuple[int, int] | None = None
) -> RankMemory:
    """All memory terms of ``rank``; ``local`` = precomputed ``(local fwd, local bwd)`` workspace.

    Forward peak = accumulators + max(local workspace, each spanning branch's forward), or at
    the end: accumulators + the returned lse copy (+ the ``out`` cast when ``s != a``). Backward
    peak = saved out, lse + gradient accumulators + max(local workspace, each spanning
    branch's backward), or at the end + the gradient casts.
    """
    if local is None:
        local = (local_forward_workspace(setup), local_backward_workspace(setup))
    accumulators, saved_out, saved_lse, grads = persistent_bytes(setup)
    branches = tuple(
        spanning_branch_memory(setup, segment, rate, transport, rank)
        for segment, rate, transport in spanning_branches(setup)
    )
    e, s, a = setup.shard_elements, setup.input_size, setup.acc_size
    lse = setup.lse_elements * a
    forward_work = max([local[0], *(b.forward_bytes for b in branches)])
    forward_end = accumulators + lse + (e * s if s != a else 0)
    forward_peak = max(accumulators + forward_work, forward_end)
    backward_work = max([local[1], *(b.backward_bytes for b in branches)])
    accumulators_bwd = 3 * e * a
    backward_peak = saved_out + saved_lse + max(accumulators_bwd + backward_work, grads)
    return RankMemory(
        rank=rank,
        saved_qkv_bytes=3 * e * s,
        saved_out_bytes=saved_out,
        saved_lse_bytes=saved_lse,
        grad_bytes=grads,
        local_forward_bytes=local[0],
        local_backward_bytes=local[1],
        branches=branches,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
    )


# -- whole group ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory of one call on every rank of the group; summaries are worst-rank."""

    setup: AttentionSetup
    ranks: tuple[RankMemory, ...] = field(repr=False)

    @property
    def peak_bytes(self) -> int:
        """Largest per-rank peak extra bytes."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def worst_rank(self) -> RankMemory:
        """The rank with the largest peak."""
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def sent_bytes_max(self) -> tuple[int, int]:
        """Largest ``(forward, backward)`` bytes any rank sends."""
        return (
            max(r.sent_forward_bytes for r in self.ranks),
            max(r.sent_backward_bytes for r in self.ranks),
        )

    @property
    def sent_bytes_mean(self) -> tuple[float, float]:
        """Mean ``(forward, backward)`` bytes sent per rank."""
        count = len(self.ranks)
        return (
            sum(r.sent_forward_bytes for r in self.ranks) / count,
            sum(r.sent_backward_bytes for r in self.ranks) / count,
        )


def plan_memory(setup: AttentionSetup, ranks: Sequence[int] | None = None) -> MemoryPlan:
    """``RankMemory`` for ``ranks`` (default: every rank of the group)."""
    local = (local_forward_workspace(setup), local_backward_workspace(setup))
    chosen = range(setup.world_size) if ranks is None else ranks
    return MemoryPlan(setup, tuple(rank_memory(setup, rank, local) for rank in chosen))


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units (``"1.50 GiB"``)."""
    if count < 1024:
        return f"{count:.0f} B"
    exponent = min(int(math.log(count, 1024)), 5)
    return f"{count / 1024**exponent:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB')[exponent]}"
