"""Where each branch's dense blocks live in the sequence, and how to gather/scatter them.

A branch ``(w, r)`` over a sequence of ``n`` tokens cuts it into segments; in every segment
head ``h`` selects the rows ``h % r, h % r + r, ...``. Heads whose selections have the same
length form one dense block shape, so a branch becomes a few :class:`BlockGroup` s, each run as
one batched kernel call on tensors of layout ``(batch * segments, heads, rows, dim)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from einops import rearrange
from torch import Tensor


@dataclass(frozen=True)
class BlockGroup:
    """``num_segments`` segments of ``segment_length`` tokens starting at ``start``; head
    ``heads[i]`` selects rows ``offsets[i] + j * rate`` (``j < rows``) of every segment."""

    start: int
    segment_length: int
    num_segments: int
    rate: int
    heads: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int

    @property
    def is_contiguous(self) -> bool:
        """True when the blocks are plain views: rate 1 (every head takes the whole segment)
        and the heads form one consecutive range."""
        return self.rate == 1 and self.heads == tuple(range(self.heads[0], self.heads[-1] + 1))

    def chunks(self, max_elements: int, row_elements: int) -> Iterator[BlockGroup]:
        """Split into groups of at most ``max_elements`` elements: whole segments when one
        segment fits, else single segments of a few heads (``row_elements`` = batch *
        head_dim elements per row and head)."""
        per_head = self.rows * row_elements
        heads_per_chunk = max(1, min(len(self.heads), max_elements // per_head))
        for first_head in range(0, len(self.heads), heads_per_chunk):
            part = restrict(self, self.heads[first_head : first_head + heads_per_chunk])
            step = max(1, max_elements // (per_head * len(part.heads)))
            for first in range(0, self.num_segments, step):
                count = min(step, self.num_segments - first)
                yield replace(
                    part, start=self.start + first * self.segment_length, num_segments=count
                )


def region_groups(
    start: int, length: int, count: int, num_heads: int, rate: int, shift: int = 0
) -> list[BlockGroup]:
    """Block groups of ``count`` regions of ``length`` tokens from ``start``.

    ``shift`` is the distance from the enclosing segment's start to the region's start (non-zero
    when a sequence shard begins inside a segment): head ``h`` then selects the region rows
    ``r`` with ``(r + shift) % rate == h % rate``.
    """
    by_rows: dict[int, list[tuple[int, int]]] = {}
    for head in range(num_heads):
        offset = (head - shift) % rate
        rows = selected_rows(length, offset, rate)
        if rows > 0:
            by_rows.setdefault(rows, []).append((head, offset))
    groups = []
    for rows, members in by_rows.items():
        heads, offsets = zip(*members)
        groups.append(BlockGroup(start, length, count, rate, heads, offsets, rows))
    return groups


def selected_rows(length: int, offset: int, rate: int) -> int:
    """How many rows ``offset, offset + rate, ...`` a head selects in a region of ``length``."""
    return -(-(length - offset) // rate)


def branch_groups(seq_len: int, num_heads: int, segment_length: int, rate: int) -> list[BlockGroup]:
    """The block groups of branch ``(segment_length, rate)`` over ``seq_len`` tokens."""
    full = seq_len // segment_length
    groups = region_groups(0, segment_length, full, num_heads, rate) if full else []
    tail = seq_len - full * segment_length
    if tail:
        groups += region_groups(full * segment_length, tail, 1, num_heads, rate)
    return groups


def restrict(group: BlockGroup, heads: Sequence[int]) -> BlockGroup:
    """``group`` limited to ``heads`` (a subset of its heads)."""
    keep = [i for i, head in enumerate(group.heads) if head in heads]
    return replace(
        group,
        heads=tuple(group.heads[i] for i in keep),
        offsets=tuple(group.offsets[i] for i in keep),
    )


def _segments(x: Tensor, group: BlockGroup) -> Tensor:
    """``x`` ``(batch, seq, heads, dim)`` -> view ``(batch, segments, length, heads, dim)``."""
    end = group.start + group.num_segments * group.segment_length
    return x[:, group.start : end].unflatten(1, (group.num_segments, group.segment_length))


def _head_rows(segments: Tensor, group: BlockGroup, head: int, offset: int) -> Tensor:
    """View ``(batch, segments, rows, dim)`` of the rows ``head`` selects (a strided slice)."""
    last = offset + (group.rows - 1) * group.rate
    return segments[:, :, offset : last + 1 : group.rate, head]


def gathers_view(group: BlockGroup, batch: int, seq_len: int) -> bool:
    """Whether ``gather(x, group)`` of a contiguous ``x`` ``(batch, seq_len, heads, dim)`` is a
    view (writes to it reach ``x``): the group is contiguous and batch and segments merge into
    one dimension (batch 1, one segment, or the segments cover the whole sequence)."""
    whole = group.num_segments * group.segment_length == seq_len
    return group.is_contiguous and (batch == 1 or group.num_segments == 1 or whole)


def gather(x: Tensor, group: BlockGroup) -> Tensor:
    """Blocks of ``x`` ``(batch, seq, heads, dim)`` -> ``(batch * segments, heads, rows, dim)``.

    A view when ``gathers_view``; otherwise a copy (one strided copy per head for dilated
    groups, no index kernels).
    """
    segments = _segments(x, group)
    if group.is_contiguous:
        heads = slice(group.heads[0], group.heads[-1] + 1)
        return rearrange(segments[:, :, :, heads], "b n w h d -> (b n) h w d")
    batch, count, _, _, dim = segments.shape
    blocks = x.new_empty(batch, count, group.rows, len(group.heads), dim)
    for i, (head, offset) in enumerate(zip(group.heads, group.offsets)):
        blocks[:, :, :, i].copy_(_head_rows(segments, group, head, offset))
    return rearrange(blocks, "b n c h d -> (b n) h c d")


def scatter_(x: Tensor, group: BlockGroup, blocks: Tensor, accumulate: bool = False) -> None:
    """Write (or add, with ``accumulate``) ``blocks`` ``(batch * segments, heads, rows, dim)``
    into their places in ``x`` ``(batch, seq, heads, dim)``, in place."""
    segments = _segments(x, group)
    blocks = rearrange(blocks, "(b n) h c d -> b n c h d", b=x.shape[0])
    if group.is_contiguous:
        target = segments[:, :, :, group.heads[0] : group.heads[-1] + 1]
        (target.add_ if accumulate else target.copy_)(blocks)
        return
    for i, (head, offset) in enumerate(zip(group.heads, group.offsets)):
        target = _head_rows(segments, group, head, offset)
        (target.add_ if accumulate else target.copy_)(blocks[:, :, :, i])
