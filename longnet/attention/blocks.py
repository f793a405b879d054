"""Where each branch's dense blocks live in the sequence, and how to gather and scatter them:
heads with equally many selected rows form a :class:`BlockGroup`, one kernel call in the layout
``(batch * segments, heads, rows, dim)`` (docs/architecture.md §3), moved by a few strided
views (:class:`Lattice`), never index kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

from einops import rearrange
from torch import Tensor


class Lattice(NamedTuple):
    """Members ``first ..`` of a group as an ``outer x inner`` grid: member ``(i, j)`` is head
    ``head + i * outer_head + j * inner_head`` with first row ``offset + i * outer_offset + j *
    inner_offset``."""

    first: int
    outer: int
    inner: int
    head: int
    offset: int
    outer_head: int
    outer_offset: int
    inner_head: int
    inner_offset: int


@dataclass(frozen=True)
class BlockGroup:
    """``num_segments`` segments of ``segment_length`` tokens from ``start``; head ``heads[i]``
    selects rows ``offsets[i] + j * rate`` (``j < rows``) of each, in batch element ``batch``
    only when set."""

    start: int
    segment_length: int
    num_segments: int
    rate: int
    heads: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int
    batch: int | None = None

    @property
    def is_contiguous(self) -> bool:
        """Rate 1 and consecutive heads: the blocks are plain views."""
        return self.rate == 1 and self.heads == tuple(range(self.heads[0], self.heads[-1] + 1))

    @cached_property
    def lattices(self) -> tuple[Lattice, ...]:
        """The members as a few strided grids (see the module docstring)."""
        return tuple(_lattices(self.heads, self.offsets))

    def chunks(self, max_elements: int, row_elements: int) -> Iterator[BlockGroup]:
        """Split into groups of at most ``max_elements`` (``row_elements`` per row and head)."""
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


@dataclass(frozen=True)
class BlockStack:
    """Block groups of one block shape, stacked along the first dimension as one kernel call."""

    groups: tuple[BlockGroup, ...]


Blocks = BlockGroup | BlockStack
"""What one kernel call attends: one group, or a stack of groups of one block shape."""


def _step(heads: Sequence[int], offsets: Sequence[int], a: int, b: int) -> tuple[int, int] | None:
    """The ``(head, offset)`` step from member ``a`` to ``b``; None if negative."""
    step = (heads[b] - heads[a], offsets[b] - offsets[a])
    return step if min(step) >= 0 else None


def _lattices(heads: Sequence[int], offsets: Sequence[int]) -> Iterator[Lattice]:
    """Greedy split into grids: runs of one step, then equally spaced runs of equal shape."""
    runs, i = [], 0
    while i < len(heads):
        end = i + 1
        step = _step(heads, offsets, i, end) if end < len(heads) else None
        if step is not None:
            while end + 1 < len(heads) and _step(heads, offsets, end, end + 1) == step:
                end += 1
            end += 1
        runs.append((i, end, step or (0, 0)))
        i = end
    r = 0
    while r < len(runs):
        first, end, inner_step = runs[r]
        outer, outer_step = 1, (0, 0)
        while r + outer < len(runs):
            start, stop, step = runs[r + outer]
            spacing = _step(heads, offsets, runs[r + outer - 1][0], start)
            if stop - start != end - first or step != inner_step or spacing is None or (
                outer > 1 and spacing != outer_step
            ):
                break
            outer, outer_step = outer + 1, spacing
        yield Lattice(first, outer, end - first, heads[first], offsets[first], *outer_step,
                      *inner_step)
        r += outer


def region_groups(
    start: int, length: int, count: int, num_heads: int, rate: int, shift: int = 0
) -> list[BlockGroup]:
    """Block groups of ``count`` regions of ``length`` tokens from ``start``; ``shift``: the
    region's distance from its segment's start (a shard beginning inside a segment)."""
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


def group_batch(group: BlockGroup, batch: int) -> int:
    """How many batch elements of a ``batch``-element input ``group`` covers."""
    return batch if group.batch is None else 1


def _lattice_view(x: Tensor, group: BlockGroup, lattice: Lattice) -> Tensor:
    """View ``(batch, segments, outer, inner, rows, dim)`` of ``x``: ``lattice``'s members' rows."""
    if group.batch is not None:
        x = x[group.batch : group.batch + 1]
    batch, seq, head, dim = x.stride()

    def member_step(head_step: int, offset_step: int) -> int:
        return offset_step * seq + head_step * head

    return x.as_strided(
        (x.shape[0], group.num_segments, lattice.outer, lattice.inner, group.rows, x.shape[3]),
        (
            batch,
            group.segment_length * seq,
            member_step(lattice.outer_head, lattice.outer_offset),
            member_step(lattice.inner_head, lattice.inner_offset),
            group.rate * seq,
            dim,
        ),
        x.storage_offset() + (group.start + lattice.offset) * seq + lattice.head * head,
    )


def gathers_view(blocks: Blocks, batch: int, seq_len: int) -> bool:
    """Whether ``gather(x, blocks)`` of a contiguous ``x`` ``(batch, seq_len, heads, dim)`` is
    a view: one contiguous group whose batch and segment dimensions merge."""
    if isinstance(blocks, BlockStack):
        return False
    whole = blocks.num_segments * blocks.segment_length == seq_len
    one_batch = group_batch(blocks, batch) == 1
    return blocks.is_contiguous and (one_batch or blocks.num_segments == 1 or whole)


def gather(x: Tensor, blocks: Blocks) -> Tensor:
    """Blocks of ``x`` ``(batch, seq, heads, dim)`` -> ``(batch * segments, heads, rows, dim)``:
    a view when ``gathers_view``, else a sequence-major copy (read fastest by fused kernels)."""
    if gathers_view(blocks, x.shape[0], x.shape[1]):
        (lattice,) = blocks.lattices
        return rearrange(_lattice_view(x, blocks, lattice), "b n i j c d -> (b n) (i j) c d")
    groups, sizes = _groups(blocks, x.shape[0])
    gathered = x.new_empty(sum(sizes), groups[0].rows, len(groups[0].heads), x.shape[3])
    for group, part in zip(groups, gathered.split(sizes)):
        part = rearrange(part, "(b n) c h d -> b n c h d", n=group.num_segments)
        for lattice, member_rows in zip(group.lattices, _member_slices(part, group)):
            member_rows.copy_(_lattice_view(x, group, lattice))
    return rearrange(gathered, "m c h d -> m h c d")


def scatter_(x: Tensor, blocks: Blocks, gathered: Tensor, accumulate: bool = False) -> None:
    """Write (or add, with ``accumulate``) ``gathered`` (``gather``'s layout) into ``x``."""
    groups, sizes = _groups(blocks, x.shape[0])
    for group, part in zip(groups, gathered.split(sizes)):
        part = rearrange(part, "(b n) h c d -> b n c h d", n=group.num_segments)
        for lattice, source in zip(group.lattices, _member_slices(part, group)):
            target = _lattice_view(x, group, lattice)
            (target.add_ if accumulate else target.copy_)(source)


def _groups(blocks: Blocks, batch: int) -> tuple[tuple[BlockGroup, ...], list[int]]:
    """The groups of ``blocks`` and how many blocks each has in the kernel layout."""
    groups = blocks.groups if isinstance(blocks, BlockStack) else (blocks,)
    return groups, [group_batch(group, batch) * group.num_segments for group in groups]


def _member_slices(blocks: Tensor, group: BlockGroup) -> Iterator[Tensor]:
    """Views ``(batch, segments, outer, inner, rows, dim)`` of ``blocks``, one per lattice."""
    for lattice in group.lattices:
        part = blocks[:, :, :, lattice.first : lattice.first + lattice.outer * lattice.inner]
        yield rearrange(part, "b n c (i j) d -> b n i j c d", i=lattice.outer)
