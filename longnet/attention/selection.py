"""Which keys the retrieval branches give (neighbours, sinks, query-aware blocks;
architecture.md §2). They join the dilated branches' softmax:
- **neighbours** ``n``: the ``n`` local segments before the query's own (and after it,
  without ``causal``), at their own positions: with them a query always sees at least ``n``
  segments of its recent past densely (Longformer's sliding chunks);
- **sinks** ``n``: the first ``n`` tokens of each document (StreamingLLM);
- **selection** ``(block, top_k)``: each local segment is cut into blocks of ``block`` tokens;
  each query scores the blocks by an upper bound of its scores (Quest's per-channel min/max,
  summed over a K/V head's query heads) and attends to its ``top_k`` best (InfLLM, Quest, NSA).
The *local segment* is the pattern's largest rate-1 branch's (the query alone without one);
its *reach* adds the neighbours. Sinks and selection give only keys outside the reach and,
with ``causal``, before it. The selection is not differentiated; ``retrieval`` attends to the
keys chosen here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.pattern import DilatedPattern
from longnet.validation import check_non_negative_int, check_positive_int


@dataclass(frozen=True)
class Retrieval:
    """The retrieval branches of an attention call.

    Args:
        sinks: the first ``sinks`` tokens of each document, keys of every query outside
            their reach (0: none).
        block: tokens per selectable block, cut from each local segment's start.
        top_k: blocks each query (per K/V head) selects (0: no selection).
        neighbors: local segments on each side of the query's own (before it only, causal)
            whose keys it sees at their own positions (0: none; needs a rate-1 branch).
    """

    sinks: int = 0
    block: int = 64
    top_k: int = 0
    neighbors: int = 0

    def __post_init__(self) -> None:
        check_non_negative_int("Retrieval: sinks", self.sinks)
        check_positive_int("Retrieval: block", self.block)
        check_non_negative_int("Retrieval: top_k", self.top_k)
        check_non_negative_int("Retrieval: neighbors", self.neighbors)

    @property
    def active(self) -> bool:
        """Whether any key comes from these branches."""
        return self.sinks > 0 or self.top_k > 0 or self.neighbors > 0


def check_retrieval(where: str, retrieval: object, pattern: DilatedPattern) -> Retrieval | None:
    """``retrieval`` if it is an active :class:`Retrieval`, else None: ``TypeError`` for
    anything else, ``ValueError`` for neighbours beside a ``pattern`` without a rate-1 branch
    (no local segment to extend)."""
    if retrieval is not None and not isinstance(retrieval, Retrieval):
        raise TypeError(
            f"{where}: retrieval must be a longnet.attention.Retrieval or None, got "
            f"{type(retrieval).__name__} {retrieval!r}; e.g. Retrieval(sinks=4, block=64, "
            "top_k=16)."
        )
    if retrieval is not None and retrieval.neighbors and local_segment_length(pattern) is None:
        raise ValueError(
            f"{where}: Retrieval(neighbors={retrieval.neighbors}) extends the local segment "
            f"of a rate-1 branch, and the pattern {pattern.branches} has none; add a branch "
            "(w, 1) or set neighbors=0."
        )
    return retrieval if retrieval is not None and retrieval.active else None


def local_segment_length(pattern: DilatedPattern) -> int | None:
    """The pattern's largest rate-1 segment, or None (the local segment is the query alone)."""
    return max((w for w, r in pattern.branches if r == 1), default=None)


@dataclass(frozen=True)
class RowGeometry:
    """Where one batch element's keys and queries (query ``i`` at key ``offset + i``) sit:
    documents per key, local segments ``[lo, hi)`` and reaches ``[reach_lo, reach_hi)`` per
    query, each block's keys, in position order."""

    doc_start: Tensor  # (keys,)
    doc_end: Tensor  # (keys,)
    lo: Tensor  # (queries,)
    hi: Tensor  # (queries,)
    reach_lo: Tensor  # (queries,)
    reach_hi: Tensor  # (queries,)
    block_start: Tensor  # (blocks,)
    block_end: Tensor  # (blocks,)
    offset: int


def row_geometry(
    lengths: Sequence[int], queries: int, pattern: DilatedPattern, retrieval: Retrieval,
    device: torch.device, first_query: int | None = None,
) -> RowGeometry:
    """The :class:`RowGeometry` of documents of ``lengths``; the queries are the ``queries``
    positions from ``first_query`` (default: the last ones)."""
    keys = sum(lengths)
    offset = keys - queries if first_query is None else first_query
    doc_start = torch.repeat_interleave(
        torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], device=device),
        torch.tensor(list(lengths), device=device),
    )
    doc_end = doc_start + torch.repeat_interleave(
        torch.tensor(list(lengths), device=device), torch.tensor(list(lengths), device=device)
    )
    window = local_segment_length(pattern)
    positions = torch.arange(offset, offset + queries, device=device)
    start = doc_start[offset:offset + queries]
    end = doc_end[offset:offset + queries]
    if window is not None:
        lo = start + (positions - start) // window * window
        hi = torch.minimum(lo + window, end)
        margin = retrieval.neighbors * window
        reach_lo, reach_hi = torch.maximum(lo - margin, start), torch.minimum(hi + margin, end)
    else:
        lo, hi = positions, positions + 1
        reach_lo, reach_hi = lo, hi
    blocks, first = [], 0
    for length in lengths:
        blocks += document_blocks(first, length, window, retrieval)
        first += length
    bounds = torch.tensor(blocks, dtype=torch.long, device=device).reshape(-1, 2).T.contiguous()
    return RowGeometry(doc_start, doc_end, lo, hi, reach_lo, reach_hi, bounds[0], bounds[1],
                       offset)


def document_blocks(first: int, length: int, window: int | None,
                    retrieval: Retrieval) -> list[tuple[int, int]]:
    """The blocks ``[(start, end), ...]`` of one document after its sinks; without a window
    an incomplete last block is left out (its keys are not all there yet when decoding)."""
    end = first + length
    segments = range(first, end, window) if window else [first]
    blocks = []
    for segment in segments:
        stop = min(segment + window, end) if window else end
        for start in range(max(segment, first + retrieval.sinks), stop, retrieval.block):
            if window or start + retrieval.block <= stop:
                blocks.append((start, min(start + retrieval.block, stop)))
    return blocks


def block_offsets(positions: Tensor, window: int | None, retrieval: Retrieval) -> Tensor:
    """Each document position's offset in its block (a sink's: its position); any shape."""
    start = positions - positions % window if window else torch.zeros_like(positions)
    grid = start.clamp(min=retrieval.sinks)  # where the key's segment is cut from
    return torch.where(positions < retrieval.sinks, positions,
                       (positions - grid) % retrieval.block)


SCORED_AT_ONCE = 4096
"""Queries scored at once by :func:`select_blocks` (bounds its score tensor)."""


@torch.no_grad()
def block_bounds(k: Tensor, row: RowGeometry, retrieval: Retrieval,
                 keys_from: int = 0) -> tuple[Tensor, Tensor]:
    """Each block's per-channel minimum and maximum key ``(blocks, kv_heads, head_dim)`` over
    its keys among ``k`` ``(keys, kv_heads, head_dim)``, the positions from ``keys_from``:
    ``+inf`` and ``-inf`` where none (under sequence parallelism, reduced over the ranks)."""
    compute = torch.promote_types(k.dtype, torch.float32)
    # a short block's rows repeat its last key: the same minimum and maximum
    rows = torch.minimum(row.block_start[:, None] + torch.arange(retrieval.block, device=k.device),
                         row.block_end[:, None] - 1) - keys_from
    present = (rows >= 0) & (rows < k.shape[0])
    members = k[rows.clamp(0, max(k.shape[0] - 1, 0))].to(compute)
    if bool(present.all()):  # one device: every key is here
        return members.amin(1), members.amax(1)
    absent = ~present[..., None, None]
    return (members.masked_fill(absent, float("inf")).amin(1),
            members.masked_fill(absent, float("-inf")).amax(1))


@torch.no_grad()
def select_blocks(q: Tensor, bounds: tuple[Tensor, Tensor], row: RowGeometry,
                  retrieval: Retrieval, causal: bool) -> Tensor:
    """Each query's ``top_k`` blocks per K/V head, by the upper bound ``sum_h sum_c max(q[h, c]
    * min_j[c], q[h, c] * max_j[c])`` of ``q . k`` in block ``j`` (ties: the earlier block).

    Args:
        q: ``(queries, heads, head_dim)`` of one batch element; bounds: :func:`block_bounds`.
    Returns:
        ``(queries, kv_heads, top_k)`` int64 block indices in no particular order, ``-1`` where
        a query has fewer candidates than ``top_k``.
    """
    low, high = bounds
    queries, kv_heads = q.shape[0], low.shape[1]
    ends = row.block_end
    chosen = q.new_full((queries, kv_heads, retrieval.top_k), -1, dtype=torch.long)
    if retrieval.top_k == 0 or len(ends) == 0:
        return chosen
    compute = low.dtype
    for first in range(0, queries, SCORED_AT_ONCE):
        part = slice(first, min(first + SCORED_AT_ONCE, queries))
        # causal: only the blocks ending before the part's last reach can be chosen
        blocks = (len(ends) if not causal else
                  int(torch.searchsorted(ends, row.reach_lo[part].max(), right=True)))
        top = min(retrieval.top_k, blocks)
        if top == 0:
            continue
        qg = rearrange(q[part].to(compute), "n (g h) d -> n g h d", g=kv_heads)
        bound = (torch.einsum("ngd,jgd->ngj", qg.clamp(min=0).sum(2), high[:blocks])
                 + torch.einsum("ngd,jgd->ngj", qg.clamp(max=0).sum(2), low[:blocks]))
        candidate = _candidates(row, slice(0, blocks), part, causal)[:, None]
        bound = bound.masked_fill(~candidate, float("-inf"))
        # above the k-th highest bound, then the earliest of those equal to it
        kth = torch.topk(bound, top, dim=-1).values[..., -1:]
        tied = (bound == kth) & candidate
        wanted = top - (bound > kth).sum(-1, keepdim=True)
        picked = ((bound > kth) | (tied & (tied.cumsum(-1) <= wanted))) & candidate
        earlier = torch.arange(blocks, 0, -1, device=q.device)  # larger for earlier blocks
        order = torch.topk(picked * earlier, top, dim=-1)
        chosen[part, :, :top] = order.indices.masked_fill(order.values == 0, -1)
    return chosen


def _candidates(row: RowGeometry, blocks: slice, part: slice, causal: bool) -> Tensor:
    """``(queries, blocks)`` bool: ``blocks`` in the query's document outside its reach."""
    starts, ends = row.block_start[blocks], row.block_end[blocks]
    same = row.doc_start[starts][None, :] == row.doc_start[row.offset + part.start:
                                                           row.offset + part.stop][:, None]
    outside = ends[None, :] <= row.reach_lo[part, None]
    if not causal:
        outside |= starts[None, :] >= row.reach_hi[part, None]
    return same & outside


def sink_keys(row: RowGeometry, sinks: int, tile: slice, causal: bool) -> tuple[Tensor, Tensor]:
    """The sinks of a query tile's documents, ``positions`` ``(keys,)``, and ``allowed``
    ``(tile, keys)`` bool: same document, outside the reach (before it if causal)."""
    device = row.lo.device
    keys = slice(row.offset + tile.start, row.offset + tile.stop)
    query_doc = row.doc_start[keys]
    starts = torch.unique_consecutive(query_doc)  # the documents of the tile, in order
    positions = torch.cat([torch.arange(doc, min(doc + sinks, end), device=device) for doc, end
                           in zip(starts.tolist(), row.doc_end[starts].tolist())])
    same = row.doc_start[positions][None, :] == query_doc[:, None]
    allowed = same & (positions[None, :] < row.reach_lo[tile, None])
    if not causal:
        allowed |= same & (positions[None, :] >= row.reach_hi[tile, None])
    return positions, allowed


def neighbor_keys(row: RowGeometry, tile: slice, causal: bool) -> tuple[Tensor, Tensor]:
    """The neighbours of a query tile, ``positions`` ``(keys,)`` and ``allowed`` ``(tile,
    keys)`` bool: inside the query's reach, outside its local segment (before it if causal)."""
    lo, hi = row.lo[tile, None], row.hi[tile, None]
    before = torch.arange(int(row.reach_lo[tile].min()), int(lo.max()), device=lo.device)
    allowed = (before >= row.reach_lo[tile, None]) & (before < lo)
    if causal:
        return before, allowed
    after = torch.arange(int(hi.min()), int(row.reach_hi[tile].max()), device=lo.device)
    allowed_after = (after >= hi) & (after < row.reach_hi[tile, None])
    return torch.cat((before, after)), torch.cat((allowed, allowed_after), dim=1)


def _block_queries(chosen: Tensor, blocks: int) -> list[list[tuple[int, Tensor]]]:
    """Per K/V head, ``[(block, queries (count,) int64), ...]`` of the chosen blocks."""
    queries, _, top_k = chosen.shape
    owners = torch.arange(queries, device=chosen.device).repeat_interleave(top_k)
    lists = []
    for choice in chosen.unbind(1):
        flat = choice.reshape(-1)
        valid = flat >= 0
        block, owner = flat[valid], owners[valid]
        order = torch.argsort(block, stable=True)
        counts = torch.bincount(block, minlength=blocks).tolist()
        lists.append([(j, part) for j, part in enumerate(owner[order].split(counts)) if len(part)])
    return lists


@dataclass
class Selection:
    """One batch element's :class:`RowGeometry`, chosen blocks and each block's queries."""

    row: RowGeometry
    chosen: Tensor
    block_queries: list[list[tuple[int, Tensor]]]

    @classmethod
    def make(cls, q: Tensor, row: RowGeometry, bounds: tuple[Tensor, Tensor],
             retrieval: Retrieval, causal: bool) -> Selection:
        """``q`` ``(queries, heads, dim)`` of one element; ``bounds``: :func:`block_bounds`."""
        chosen = select_blocks(q, bounds, row, retrieval, causal)
        return cls(row, chosen, _block_queries(chosen, len(row.block_start)))


def select(q: Tensor, k: Tensor, lengths: Sequence[int], pattern: DilatedPattern,
           retrieval: Retrieval, causal: bool) -> Selection:
    """The :class:`Selection` of one batch element on one device: ``q`` ``(queries, heads,
    dim)``, the last of the keys ``k`` ``(keys, kv_heads, dim)`` of documents of ``lengths``."""
    row = row_geometry(lengths, q.shape[0], pattern, retrieval, q.device)
    return Selection.make(q, row, block_bounds(k, row, retrieval), retrieval, causal)

