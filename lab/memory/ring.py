"""Memory and traffic of the branches whose segments span ranks (``attention/ring.py``), one
piece at a time, for either transport.

A branch ``(w, r)`` spanning ``g`` ranks runs as pieces of a few heads each
(``plan.spanning.heads_per_piece``); a piece packs this rank's selected K and V rows of its
heads into one message of ``M = 2 * batch * heads_per_piece * R * head_dim`` elements
(``R = ceil(L / r)``, ``message_rows``). Communication counts the payload bytes of the
point-to-point sends (``batch_isend_irecv``); the call check (one 24-byte ``all_reduce`` the
first time a group meets a signature, ``dilated.agree_on_call``) is not counted.
With drifting offsets the block work is an upper bound (all heads of a piece in one block of
``ceil(L / r)`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.memory.local import _lse_part
from lab.memory.setup import MERGE_TEMPORARIES, AttentionSetup
from lab.memory.workspace import kernel_workspace_backward, kernel_workspace_forward
from longnet.attention.blocks import selected_rows
from longnet.attention.plan.spanning import heads_per_piece, segment_group
from longnet.attention.ring import Schedule


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

    The branch runs piece by piece (``plan.spanning.heads_per_piece``: at most
    ``setup.block_elements`` elements per message); memory is that of the largest piece,
    traffic the sum over pieces.
    """
    _, members = segment_group(rank, setup.shard_len, segment, setup.seq_len)
    schedule = Schedule(len(members), rank - members[0], setup.causal)
    rows = message_rows(setup, segment, rate, rank)
    per_piece = heads_per_piece(
        rows, setup.row_elements, setup.num_heads, setup.block_elements
    )
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


