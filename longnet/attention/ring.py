"""Sequence parallelism: queries stay local, selected K/V rows travel (docs/architecture.md §4).

A process group of ``P`` ranks holds contiguous shards of ``L = N / P`` tokens. A branch whose
segment length ``w`` divides ``L`` is local (no communication; ``local.py`` runs it). A branch
with ``w`` a multiple of ``L`` has segments spanning ``g = w / L`` consecutive ranks (its
segment group); only the dilated rows of K and V travel, only among those ranks, as
:class:`SpanningPiece` s of a few heads each, moved by either transport (``transport.py``):

- ``ring``: the packed K/V block rotates around the sub-ring with one batched send/recv per
  hop; the next hop is posted before the current block is computed. In the backward, the dK/dV
  accumulator travels with its block and arrives home after the full loop.
- ``allgather``: every rank receives every block of its segment group at once; the backward
  sends each block's dK/dV partial sums straight to the block's owner.

Dilation offsets may drift from rank to rank (when ``r`` does not divide ``L``): every rank
knows every member's selected rows from the global geometry, so this is handled exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.layout import (
    BlockGroup,
    branch_groups,
    gather,
    region_groups,
    restrict,
    scatter_,
)
from longnet.attention.merge import BackwardQueries, QueryRows, lse_merge_
from longnet.attention.pattern import DilatedPattern
from longnet.attention.transport import Peers, Schedule

if TYPE_CHECKING:
    from longnet.attention.plan import AttentionPlan


def _branch_fits(segment_length: int, shard_len: int) -> bool:
    return shard_len % segment_length == 0 or segment_length % shard_len == 0


def fits_shards(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> bool:
    """Whether ``world_size`` ranks run ``pattern`` on ``seq_len`` tokens as they are: the
    length divides into equal shards and every branch's segment length (capped at the
    sequence length) divides the shard length or is a multiple of it."""
    if seq_len % world_size:
        return False
    shard_len = seq_len // world_size
    pattern = DilatedPattern.coerce(pattern)
    return all(_branch_fits(min(w, seq_len), shard_len) for w in pattern.segment_lengths)


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
    while not fits_shards(shard_len * world_size, pattern, world_size):
        shard_len += 1
    return shard_len * world_size


Attend = Callable[[Tensor, int, Tensor | None], None]
"""``attend(kv block, source member, dK/dV partial or None)``: compute with one block."""


class ForwardQueries(NamedTuple):
    """One query group of a piece in the forward: its accumulator rows and its queries."""

    rows: QueryRows
    q: Tensor


class BackwardEntry(NamedTuple):
    """One query group of a piece in the backward: what its queries need, and their dQ."""

    group: BlockGroup
    rows: BackwardQueries
    d_q: Tensor


@dataclass(frozen=True)
class SpanningPiece:
    """A piece of one branch whose segments span several ranks: its heads ``heads`` (a few, so
    that one message stays within the block budget), seen from one rank; either transport.

    ``members`` are the group ranks of this rank's segment group in sequence order, ``index``
    this rank's place among them, ``member_groups[m]`` the rows member ``m`` selects for
    ``heads`` (shard coordinates; a few head groups when dilation offsets drift).
    ``query_groups``: this rank's groups split so that each one's heads lie in one group of
    every member; its query-side rows are gathered once and meet every arriving block.
    Tensors use the sequence layout ``(batch, shard, heads, dim)`` (``lse``: ``dim`` = 1).
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

    def _key_blocks(
        self, kv: Tensor, source: int, query_groups: Sequence[BlockGroup]
    ) -> Iterator[tuple[int, slice | Tensor, Tensor, Tensor]]:
        """``(query group number, head index, k block, v block)`` for every query group that
        meets member ``source``'s block ``kv``; the head index places the group's heads in
        ``kv``'s head dimension."""
        for number, query_group in enumerate(query_groups):
            rows = self.key_rows(query_group, source)
            if rows:
                index = self.positions(query_group.heads, kv.device)
                yield number, index, kv[0][:, index, :rows], kv[1][:, index, :rows]

    def _exchange(
        self,
        peers: Peers,
        kv: Tensor,
        causal: bool,
        attend: Attend,
        grad_dtype: torch.dtype | None = None,
    ) -> Tensor | None:
        """Run the :class:`Schedule`: ``attend(block, source, d_block)`` for every block this
        rank computes with, as the transport delivers them; ``kv`` is this rank's ``pack``.

        Forward (``grad_dtype`` None): ``d_block`` is None, and so is the result. Backward:
        ``d_block`` is a zeroed ``pack``-shaped dK/dV partial in ``grad_dtype`` that ``attend``
        adds into; every partial reaches its block's owner, and the sum of those for this
        rank's block is returned.
        """
        schedule = Schedule(len(self.members), self.index, causal)

        def zeros() -> Tensor | None:
            return None if grad_dtype is None else torch.zeros_like(kv, dtype=grad_dtype)

        if self.transport == "allgather":
            gathered = peers.all_gather(kv)
            partials: list[Tensor | None] = [None] * schedule.size
            for source in schedule.sources:
                partials[source] = zeros()
                attend(gathered[source], source, partials[source])
            return None if grad_dtype is None else peers.reduce_to_owners(partials, schedule)
        d_kv = zeros()
        for hop in schedule.hops():
            incoming = None if hop.last else peers.shift(kv, hop.number)
            if hop.attended:
                attend(kv, hop.source, d_kv)
            if d_kv is not None:  # the dK/dV accumulator travels with its block
                d_kv = peers.shift(d_kv, hop.number, tag=1)()
            if incoming is not None:
                kv = incoming()
        return d_kv

    def _peers(self, plan: AttentionPlan, phase: str) -> Peers:
        return Peers(plan.process_group, self.members, self.index, f"{self.label}, {phase}")

    def forward_(
        self, out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan
    ) -> None:
        """Merge the attention of this piece into ``out``/``lse`` (sequence layout, in place)."""
        forward, scale = plan.kernel.forward, plan.scale
        queries = [ForwardQueries(QueryRows.gather(out, lse, g), gather(q, g))
                   for g in self.query_groups]

        def attend(kv: Tensor, source: int, _: None) -> None:
            diagonal = plan.causal and source == self.index
            for number, _, k_b, v_b in self._key_blocks(kv, source, self.query_groups):
                rows, q_b = queries[number]
                block_out, block_lse = forward(q_b, k_b, v_b, diagonal, scale)
                lse_merge_(rows.out, rows.lse, block_out, block_lse)

        self._exchange(self._peers(plan, "forward"), self.pack(k, v), plan.causal, attend)
        for rows, _ in queries:
            rows.write_back_(out, lse)

    def backward_(
        self,
        grads: Sequence[Tensor],
        d_out: Tensor,
        d_lse: Tensor | None,
        saved: Sequence[Tensor],
        plan: AttentionPlan,
    ) -> None:
        """Add this piece's gradients into ``grads = (dq, dk, dv)`` (sequence layout, in
        place); ``saved = (q, k, v, out, lse)``, the forward's inputs and global results."""
        q, k, v, out, lse = saved
        entries = []
        for group in self.query_groups:
            rows = BackwardQueries.gather(d_out, q, out, lse, d_lse, group)
            d_q = torch.zeros_like(rows.q, dtype=grads[0].dtype)
            entries.append(BackwardEntry(group, rows, d_q))

        def attend(kv: Tensor, source: int, d_kv: Tensor) -> None:
            diagonal = plan.causal and source == self.index
            for number, index, k_b, v_b in self._key_blocks(kv, source, self.query_groups):
                rows, d_q_b = entries[number].rows, entries[number].d_q
                d_q, d_k, d_v = plan.kernel.block_backward(
                    rows.d_out, rows.q, k_b, v_b, rows.out, rows.lse, rows.d_lse, diagonal,
                    plan.scale,
                )
                d_q_b += d_q
                key_rows = k_b.shape[-2]
                d_kv[0][:, index, :key_rows] += d_k
                d_kv[1][:, index, :key_rows] += d_v

        peers = self._peers(plan, "backward")
        own = self._exchange(peers, self.pack(k, v), plan.causal, attend, grads[0].dtype)
        self.unpack_add_(grads[1], grads[2], own)
        for entry in entries:
            scatter_(grads[0], entry.group, entry.d_q, accumulate=True)


def plan_sequence_parallel(
    pattern: DilatedPattern,
    shard_len: int,
    world_size: int,
    rank: int,
    num_heads: int,
    transports: Sequence[str],
    row_elements: int,
    block_elements: int,
) -> tuple[list[list[BlockGroup]], list[SpanningPiece]]:
    """Split ``pattern`` into local branches (their block groups) and the pieces of branches
    spanning ranks, for group rank ``rank``; ``row_elements`` = batch * head_dim and
    ``block_elements`` size the pieces (see ``heads_per_piece``)."""
    seq_len = shard_len * world_size
    local: list[list[BlockGroup]] = []
    pieces: list[SpanningPiece] = []
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
        start, members = segment_group(rank, shard_len, segment, seq_len)
        member_groups = tuple(
            tuple(region_groups(0, shard_len, 1, num_heads, r, shift=m * shard_len - start))
            for m in members
        )
        index = rank - members[0]
        for heads, groups in ring_pieces(member_groups, num_heads, row_elements, block_elements):
            label = f"branch w={w} r={r} heads {heads[0]}-{heads[-1]}"
            queries = query_groups(groups[index], groups)
            pieces.append(SpanningPiece(members, index, groups, transport, label, heads, queries))
    return local, pieces


def segment_group(
    rank: int, shard_len: int, segment: int, seq_len: int
) -> tuple[int, tuple[int, ...]]:
    """``(start, members)`` for a branch whose ``segment`` (a multiple of ``shard_len``) spans
    ranks: the first token of ``rank``'s segment and the ranks holding it, in sequence order
    (the last segment may be cut at ``seq_len``)."""
    start = rank * shard_len // segment * segment
    return start, tuple(range(start // shard_len, min(start + segment, seq_len) // shard_len))


def heads_per_piece(rows: int, row_elements: int, num_heads: int, block_elements: int) -> int:
    """Heads per piece of a spanning branch whose members select at most ``rows`` rows per
    head: one message (K and V rows of a piece's heads, ``row_elements`` = batch * head_dim per
    row) holds at most ``block_elements`` elements, and at least one head."""
    return min(num_heads, max(1, block_elements // (2 * rows * row_elements)))


def ring_pieces(
    member_groups: Sequence[Sequence[BlockGroup]], num_heads: int, row_elements: int,
    block_elements: int,
) -> list[tuple[tuple[int, ...], tuple[tuple[BlockGroup, ...], ...]]]:
    """Split a branch spanning ranks (either transport) by heads (``heads_per_piece``):
    ``(heads, member groups)`` per piece. Every member of a segment group computes the same
    pieces (same global geometry)."""
    rows = max(group.rows for groups in member_groups for group in groups)
    per_piece = heads_per_piece(rows, row_elements, num_heads, block_elements)
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


def agree_on_call(
    signature: str, block_elements: int, process_group: dist.ProcessGroup, device: torch.device
) -> int:
    """Raise on every rank if any rank of ``process_group`` called with a different
    ``signature``; return the smallest ``block_elements`` of the group (every member of a
    segment group must cut a branch into the same pieces, whatever its free memory)."""
    code = zlib.crc32(signature.encode())
    values = torch.tensor([code, -code, -block_elements], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
    if values[0].item() != code or -values[1].item() != code:
        raise ValueError(
            f"dilated_attention: rank {dist.get_rank(process_group)} of the sequence-parallel "
            f"group was called with ({signature}) but another rank passed different shapes, "
            "dtype, pattern or options; every rank must pass equal-length shards and the same "
            "arguments."
        )
    return int(-values[2].item())
