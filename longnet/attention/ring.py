"""Sequence parallelism: queries stay local, selected K/V rows travel (docs/architecture.md §4).

A group of ``P`` ranks holds contiguous shards of ``L = N / P`` tokens. A branch whose segment
length ``w`` divides ``L`` is local (no communication). A branch with ``w`` a multiple of ``L``
has segments spanning ``g = w / L`` consecutive ranks (its segment group); only the dilated rows
of K and V travel, only among those ranks:

- ``ring``: the packed K/V block rotates around the sub-ring with one batched send/recv per
  hop; the next hop is posted before the current block is computed. In the backward, the dK/dV
  accumulator travels with its block and arrives home after the full loop.
- ``allgather``: LongNet's scheme: every rank receives every block of its segment group at once;
  the backward sends each block's dK/dV partial sums straight to the block's owner.

Dilation offsets may drift from rank to rank (when ``r`` does not divide ``L``): every rank
knows every member's selected rows from the global geometry, so this is handled exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention import blocks
from longnet.attention.blocks import block_backward, query_side
from longnet.attention.kernels import select_kernels
from longnet.attention.layout import (
    BlockGroup,
    branch_groups,
    gather,
    region_groups,
    restrict,
    scatter_,
)
from longnet.attention.merge import lse_merge_
from longnet.attention.pattern import DilatedPattern

TRANSPORTS = ("ring", "allgather")


def _branch_fits(segment_length: int, shard_len: int) -> bool:
    return shard_len % segment_length == 0 or segment_length % shard_len == 0


def padded_length(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> int:
    """The smallest length ``>= seq_len`` that ``world_size`` ranks can run ``pattern`` on.

    Every branch's segment length (capped at the sequence length) must divide the shard length
    ``L = length / world_size`` or be a multiple of it. Padding at the end is exact for causal
    attention (no real query sees a later token); for bidirectional attention pad tokens are keys.
    """
    pattern = DilatedPattern.coerce(pattern)
    if seq_len < 1 or world_size < 1:
        raise ValueError(
            f"padded_length: need seq_len >= 1 and world_size >= 1, got {seq_len}, {world_size}."
        )
    shard_len = -(-seq_len // world_size)
    while not all(
        _branch_fits(min(w, shard_len * world_size), shard_len) for w in pattern.segment_lengths
    ):
        shard_len += 1
    return shard_len * world_size


@dataclass(frozen=True)
class RingBranch:
    """The heads ``heads`` of one branch whose segments span several ranks, seen from one rank.

    ``members`` are the group ranks of this rank's segment group in sequence order, ``index``
    this rank's place among them, ``member_groups[m]`` the rows member ``m`` selects for
    ``heads`` (shard coordinates; a few head groups when dilation offsets drift). A branch runs
    as several such pieces, a few heads each, so that one message stays small.
    ``query_groups``: this rank's groups split so that each one's heads lie in one group of
    every member; its query-side rows are gathered once and meet every arriving block.
    """

    members: tuple[int, ...]
    index: int
    member_groups: tuple[tuple[BlockGroup, ...], ...]
    transport: str
    label: str
    heads: tuple[int, ...]
    query_groups: tuple[BlockGroup, ...]

    @property
    def rows_max(self) -> int:
        return max(group.rows for groups in self.member_groups for group in groups)

    def positions(self, heads: Sequence[int], device: torch.device) -> slice | Tensor:
        """Where ``heads`` sit in the message's head dimension (a slice when consecutive)."""
        where = [self.heads.index(head) for head in heads]
        if where == list(range(where[0], where[0] + len(where))):
            return slice(where[0], where[0] + len(where))
        return torch.tensor(where, device=device)

    def key_rows(self, query_group: BlockGroup, source: int) -> int:
        """Rows of member ``source``'s block for the heads of ``query_group`` (0: none)."""
        head = query_group.heads[0]
        return next((g.rows for g in self.member_groups[source] if head in g.heads), 0)

    def skipped(self, source: int, causal: bool) -> bool:
        """Causal: keys of later ranks are all in the future."""
        return causal and source > self.index

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        """This rank's selected K and V rows of ``heads`` as one message
        ``(2, batch, len(heads), rows_max, dim)``."""
        batch, _, _, dim = k.shape
        packed = k.new_zeros(2, batch, len(self.heads), self.rows_max, dim)
        for group in self.member_groups[self.index]:
            index = self.positions(group.heads, k.device)
            packed[0][:, index, : group.rows] = gather(k, group)
            packed[1][:, index, : group.rows] = gather(v, group)
        return packed

    def unpack_add_(self, d_k: Tensor, d_v: Tensor, packed: Tensor) -> None:
        """Add a ``pack``-shaped gradient of this rank's rows into ``d_k``/``d_v`` (in place)."""
        for group in self.member_groups[self.index]:
            index = self.positions(group.heads, d_k.device)
            scatter_(d_k, group, packed[0][:, index, : group.rows], accumulate=True)
            scatter_(d_v, group, packed[1][:, index, : group.rows], accumulate=True)

    def _blocks(self, kv: Tensor, source: int, queries: list):
        """``(query entry, head index, k block, v block)`` for every query group that meets
        ``source``; the head index places the group's heads in ``kv``'s head dimension."""
        for entry in queries:
            query_group = entry[0]
            rows = self.key_rows(query_group, source)
            if rows:
                index = self.positions(query_group.heads, kv.device)
                yield entry, index, kv[0][:, index, :rows], kv[1][:, index, :rows]

    def _each_block(self, peers: _Peers, kv: Tensor, causal: bool, attend) -> None:
        """Call ``attend(kv block, source)`` for every block this rank needs, as the transport
        delivers them (forward: K/V only; see ``backward_`` for the travelling gradients)."""
        if self.transport == "allgather":
            for source, block in enumerate(peers.all_gather(kv)):
                if not self.skipped(source, causal):
                    attend(block, source)
            return
        size = len(self.members)
        for hop in range(size):
            source = (self.index - hop) % size
            incoming = peers.shift(kv, hop) if hop + 1 < size else None
            if not self.skipped(source, causal):
                attend(kv, source)
            if incoming is not None:
                kv = incoming()

    # -- forward ---------------------------------------------------------------------------

    def forward_(self, out, lse, q, k, v, causal: bool, scale: float, group) -> None:
        """Merge the attention of this branch into ``out``/``lse`` (sequence layout, in place)."""
        forward, _ = select_kernels(q.device, q.dtype)
        queries = [
            (g, gather(q, g), gather(out, g), gather(lse, g)[..., 0]) for g in self.query_groups
        ]

        def attend(kv: Tensor, source: int) -> None:
            diagonal = causal and source == self.index
            for (_, q_b, out_b, lse_b), _, k_b, v_b in self._blocks(kv, source, queries):
                block_out, block_lse = forward(q_b, k_b, v_b, diagonal, scale)
                lse_merge_(out_b, lse_b, block_out, block_lse)

        self._each_block(_Peers(group, self, "forward"), self.pack(k, v), causal, attend)
        for query_group, _, out_b, lse_b in queries:
            blocks.write_back_(out, lse, query_group, out_b, lse_b)

    # -- backward --------------------------------------------------------------------------

    def backward_(
        self, grads, d_out, q, k, v, out, lse, d_lse, causal: bool, scale: float, group
    ) -> None:
        """Add this branch's gradients into ``grads = (dq, dk, dv)`` (sequence layout, in place)."""
        peers = _Peers(group, self, "backward")
        queries = []
        for query_group in self.query_groups:
            side = query_side(d_out, q, out, lse, d_lse, query_group)
            queries.append((query_group, *side, torch.zeros_like(side[1], dtype=grads[0].dtype)))

        def attend(kv: Tensor, d_kv: Tensor, source: int) -> None:
            diagonal = causal and source == self.index
            for entry, index, k_b, v_b in self._blocks(kv, source, queries):
                _, d_out_b, q_b, out_b, lse_b, d_lse_b, d_q_b = entry
                d_q, d_k, d_v = block_backward(
                    d_out_b, q_b, k_b, v_b, out_b, lse_b, d_lse_b, diagonal, scale
                )
                d_q_b += d_q
                rows = k_b.shape[-2]
                d_kv[0][:, index, :rows] += d_k
                d_kv[1][:, index, :rows] += d_v

        kv = self.pack(k, v)
        size = len(self.members)
        if self.transport == "allgather":
            blocks = peers.all_gather(kv)
            partials = [None] * size
            for source, block in enumerate(blocks):
                if not self.skipped(source, causal):
                    partials[source] = torch.zeros_like(kv, dtype=grads[0].dtype)
                    attend(block, partials[source], source)
            own = peers.reduce_to_owners(partials, causal)
        else:
            own = torch.zeros_like(kv, dtype=grads[0].dtype)
            for hop in range(size):
                source = (self.index - hop) % size
                incoming = peers.shift(kv, hop) if hop + 1 < size else None
                if not self.skipped(source, causal):
                    attend(kv, own, source)
                own = peers.shift(own, hop, tag=1)()  # the accumulator travels with its block
                if incoming is not None:
                    kv = incoming()
        self.unpack_add_(grads[1], grads[2], own)
        for query_group, *_, d_q_b in queries:
            scatter_(grads[0], query_group, d_q_b, accumulate=True)


class _Peers:
    """Batched point-to-point exchanges among the members of one segment group."""

    def __init__(self, group, branch: RingBranch, phase: str) -> None:
        group_ranks = dist.get_process_group_ranks(group)
        self.group = group
        self.branch = branch
        self.ranks = [group_ranks[member] for member in branch.members]
        self.where = f"rank {dist.get_rank()} ({branch.label}, {phase})"

    def _post(self, ops: list[dist.P2POp], step: str) -> Callable[[], None]:
        """Start ``ops`` as one batch; returns a function that waits for all of them (and keeps
        their tensors alive until then), raising an error that names the rank and the step."""
        works = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
            except Exception as error:  # a dead or mismatched peer: say who and where
                raise RuntimeError(
                    f"dilated_attention: {self.where} failed at {step}: {error}"
                ) from error
            ops.clear()

        return wait

    def shift(self, tensor: Tensor, hop: int, tag: int = 0) -> Callable[[], Tensor]:
        """Post: send ``tensor`` to the next member, receive the previous member's; returns a
        function that waits and gives the received tensor."""
        size = len(self.ranks)
        if size == 1:
            return lambda: tensor
        index = self.branch.index
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(
                dist.isend, tensor.contiguous(), self.ranks[(index + 1) % size], self.group, tag
            ),
            dist.P2POp(dist.irecv, received, self.ranks[(index - 1) % size], self.group, tag),
        ]
        wait = self._post(ops, f"hop {hop}")
        return lambda: (wait(), received)[1]

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every member's ``tensor`` (same shape everywhere), in member order."""
        blocks = [
            tensor if m == self.branch.index else torch.empty_like(tensor)
            for m in range(len(self.ranks))
        ]
        ops = []
        for member, rank in enumerate(self.ranks):
            if member != self.branch.index:
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), rank, self.group))
                ops.append(dist.P2POp(dist.irecv, blocks[member], rank, self.group))
        if ops:
            self._post(ops, "all-gather")()
        return blocks

    def reduce_to_owners(self, partials: list[Tensor | None], causal: bool) -> Tensor:
        """Send ``partials[m]`` to member ``m``; return the sum of the partials for this rank's
        block (causal: member ``i`` has a partial for ``m`` only when ``m <= i``)."""
        me = self.branch.index
        total = partials[me].clone()
        received, ops = [], []
        for member, rank in enumerate(self.ranks):
            if member == me:
                continue
            if partials[member] is not None:
                ops.append(dist.P2POp(dist.isend, partials[member], rank, self.group))
            if not (causal and me > member):
                buffer = torch.empty_like(total)
                received.append(buffer)
                ops.append(dist.P2POp(dist.irecv, buffer, rank, self.group))
        if ops:
            self._post(ops, "reduce")()
        for buffer in received:
            total += buffer
        return total


def plan_sequence_parallel(
    pattern: DilatedPattern,
    shard_len: int,
    world_size: int,
    rank: int,
    num_heads: int,
    transports: Sequence[str],
    row_elements: int,
) -> tuple[list[list[BlockGroup]], list[RingBranch]]:
    """Split ``pattern`` into local branches (their block groups) and ring branch pieces for
    group rank ``rank``; ``row_elements`` = batch * head_dim (sizes the pieces, see
    ``ring_pieces``)."""
    seq_len = shard_len * world_size
    local: list[list[BlockGroup]] = []
    rings: list[RingBranch] = []
    for (w, r), transport in zip(pattern.branches, transports):
        segment = min(w, seq_len)
        if not _branch_fits(segment, shard_len):
            raise ValueError(
                f"dilated_attention: branch (w={w}, r={r}) cannot be split over {world_size} "
                "ranks: "
                f"its segment length {segment} neither divides nor is a multiple of the shard "
                f"length {shard_len}. Pad the sequence to "
                f"longnet.attention.padded_length({seq_len}, pattern, {world_size}) = "
                f"{padded_length(seq_len, pattern, world_size)} tokens, or change the pattern."
            )
        if segment <= shard_len:
            local.append(branch_groups(shard_len, num_heads, segment, r))
            continue
        start = rank * shard_len // segment * segment
        members = tuple(range(start // shard_len, min(start + segment, seq_len) // shard_len))
        member_groups = tuple(
            tuple(region_groups(0, shard_len, 1, num_heads, r, shift=m * shard_len - start))
            for m in members
        )
        index = rank - members[0]
        for heads, groups in ring_pieces(member_groups, num_heads, row_elements):
            label = f"branch w={w} r={r} heads {heads[0]}-{heads[-1]}"
            queries = query_groups(groups[index], groups)
            rings.append(RingBranch(members, index, groups, transport, label, heads, queries))
    return local, rings


def ring_pieces(
    member_groups: Sequence[Sequence[BlockGroup]], num_heads: int, row_elements: int
) -> list[tuple[tuple[int, ...], tuple[tuple[BlockGroup, ...], ...]]]:
    """Split a ring branch by heads so that one message (K and V rows of a piece's heads)
    holds at most ``blocks.CHUNK_ELEMENTS`` elements: ``(heads, member groups)`` per piece.
    Every member of a segment group computes the same pieces (same global geometry)."""
    rows = max(group.rows for groups in member_groups for group in groups)
    per_piece = max(1, blocks.CHUNK_ELEMENTS // (2 * rows * row_elements))
    pieces = []
    for first in range(0, num_heads, per_piece):
        heads = tuple(range(first, min(first + per_piece, num_heads)))
        groups = tuple(
            tuple(restrict(group, heads) for group in groups if set(group.heads) & set(heads))
            for groups in member_groups
        )
        if any(groups):
            pieces.append((heads, groups))
    return pieces


def query_groups(
    own: Sequence[BlockGroup], member_groups: Sequence[Sequence[BlockGroup]]
) -> tuple[BlockGroup, ...]:
    """``own`` split so that the heads of each part lie in one group of every member (with
    drifting offsets a head's row count differs from member to member)."""
    parts = []
    for group in own:
        by_keys: dict[tuple[int, ...], list[int]] = {}
        for head in group.heads:
            key = tuple(
                next((i for i, g in enumerate(groups) if head in g.heads), -1)
                for groups in member_groups
            )
            by_keys.setdefault(key, []).append(head)
        parts += [restrict(group, heads) for heads in by_keys.values()]
    return tuple(parts)


def check_same_call_everywhere(signature: str, group, device: torch.device) -> None:
    """Raise on every rank if any rank of ``group`` called with a different ``signature``."""
    code = zlib.crc32(signature.encode())
    both = torch.tensor([code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both[0].item() != code or -both[1].item() != code:
        raise ValueError(
            f"dilated_attention: rank {dist.get_rank(group)} of the sequence-parallel group was "
            f"called with ({signature}) but another rank passed different shapes, dtype, pattern "
            "or options; every rank must pass equal-length shards and the same arguments."
        )
