"""Retrieval branches: attention sinks and query-aware block selection (docs/architecture.md §2).

A dilated branch ``(w, r)`` shows a query only the keys at its own offset modulo ``r``. The
two branch kinds here reach a key at any offset, and join the dilated branches in the one
softmax over the multiset union of keys:

- **sinks** ``n``: the first ``n`` tokens of each document (StreamingLLM's attention sinks);
- **selection** ``(block, top_k)``: the rest of each document is cut into blocks of ``block``
  tokens; each query scores every complete block by an upper bound of its attention scores
  (Quest's per-channel min/max bound, summed over the query heads of one K/V head) and
  attends exactly to every token of its ``top_k`` best blocks (InfLLM, Quest, NSA's selection).

Both give only keys outside the query's *local segment* (the segment of the pattern's largest
rate-1 branch that holds it; the query alone for a pattern without one) and, with ``causal``,
before it: the dense local branch already gives the rest. The selection is a function of the
inputs, not differentiated; gradients flow through the attention given the selection.

The attention is computed in query tiles: a tile gathers the sinks and the union of the blocks
its queries selected once, and masks each query to its own; no copy of K/V is made per query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.pattern import DilatedPattern
from longnet.validation import check_non_negative_int, check_positive_int

QUERY_TILE = 128
"""Queries per tile: a tile's keys are the sinks plus the union of its queries' blocks."""


@dataclass(frozen=True)
class Retrieval:
    """The retrieval branches of an attention call.

    Args:
        sinks: the first ``sinks`` tokens of each document are keys of every query outside
            their local segment (0: none).
        block: tokens per selectable block; blocks are cut from each document's first token
            after the sinks.
        top_k: blocks each query (per K/V head) selects (0: no selection).
    """

    sinks: int = 0
    block: int = 64
    top_k: int = 0

    def __post_init__(self) -> None:
        check_non_negative_int("Retrieval: sinks", self.sinks)
        check_positive_int("Retrieval: block", self.block)
        check_non_negative_int("Retrieval: top_k", self.top_k)

    @property
    def active(self) -> bool:
        """Whether any key comes from these branches."""
        return self.sinks > 0 or self.top_k > 0

    def keys_per_query(self) -> int:
        """The most keys these branches give one query (per head)."""
        return self.sinks + self.top_k * self.block if self.active else 0


@dataclass(frozen=True)
class _Row:
    """Where the queries and keys of one batch element sit.

    Key ``t`` (``0 .. keys - 1``) and query ``i`` (at key position ``offset + i``) carry their
    document's start and end; each query its local segment ``[lo, hi)``; each block (sorted by
    position) its ``start`` and the document it lies in.
    """

    doc_start: Tensor  # (keys,)
    doc_end: Tensor  # (keys,)
    lo: Tensor  # (queries,)
    hi: Tensor  # (queries,)
    block_start: Tensor  # (blocks,)
    offset: int


def _row_geometry(
    lengths: Sequence[int], queries: int, pattern: DilatedPattern, retrieval: Retrieval,
    device: torch.device,
) -> _Row:
    """The :class:`_Row` of one batch element whose documents have ``lengths`` (in order,
    covering every key); the queries are its last ``queries`` positions."""
    keys = sum(lengths)
    doc_start = torch.repeat_interleave(
        torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], device=device),
        torch.tensor(list(lengths), device=device),
    )
    doc_end = doc_start + torch.repeat_interleave(
        torch.tensor(list(lengths), device=device), torch.tensor(list(lengths), device=device)
    )
    dense = [w for w, r in pattern.branches if r == 1]
    positions = torch.arange(keys - queries, keys, device=device)
    start = doc_start[keys - queries:]
    if dense:
        lo = start + (positions - start) // dense[-1] * dense[-1]
        hi = torch.minimum(lo + dense[-1], doc_end[keys - queries:])
    else:
        lo, hi = positions, positions + 1
    block_starts = []
    first = 0
    for length in lengths:
        block_starts += range(first + retrieval.sinks, first + length - retrieval.block + 1,
                              retrieval.block)
        first += length
    return _Row(doc_start, doc_end, lo, hi,
                torch.tensor(block_starts, dtype=torch.long, device=device), keys - queries)


@torch.no_grad()
def select_blocks(q: Tensor, k: Tensor, row: _Row, retrieval: Retrieval, causal: bool) -> Tensor:
    """Each query's ``top_k`` blocks for each K/V head, as indices into ``row.block_start``.

    The score of block ``j`` for query ``p`` and K/V head ``g`` is ``sum over the query heads
    h of g, sum over channels c of max(q[p, h, c] * min_j[g, c], q[p, h, c] * max_j[g, c])``,
    an upper bound of ``q . k`` over the block's keys (``min_j``/``max_j``: the channel's
    extremes over the block). Candidates: complete blocks of the query's document outside its
    local segment (with ``causal``: ending before it). The highest ``top_k`` win, the earlier
    block on a tie.

    Args:
        q: ``(queries, heads, head_dim)``; k: ``(keys, kv_heads, head_dim)`` of one batch element.
    Returns:
        ``(queries, kv_heads, top_k)`` int64 block indices, ``-1`` where a query has fewer
        candidates than ``top_k``.
    """
    queries, kv_heads = q.shape[0], k.shape[1]
    starts = row.block_start
    if retrieval.top_k == 0 or len(starts) == 0:
        return q.new_full((queries, kv_heads, retrieval.top_k), -1, dtype=torch.long)
    compute = torch.promote_types(q.dtype, torch.float32)
    members = k[starts[:, None] + torch.arange(retrieval.block, device=k.device)].to(compute)
    low, high = members.amin(1), members.amax(1)  # (blocks, kv_heads, dim)
    q = rearrange(q.to(compute), "n (g h) d -> n g h d", g=kv_heads)
    bound = (torch.einsum("ngd,jgd->ngj", q.clamp(min=0).sum(2), high)
             + torch.einsum("ngd,jgd->ngj", q.clamp(max=0).sum(2), low))
    ends = starts + retrieval.block
    block_doc = row.doc_start[starts]
    query_doc = row.doc_start[row.offset:]
    candidate = (block_doc[None, :] == query_doc[:, None]) & (ends[None, :] <= row.lo[:, None])
    if not causal:
        candidate |= (block_doc[None, :] == query_doc[:, None]) & (
            starts[None, :] >= row.hi[:, None])
    bound = bound.masked_fill(~candidate[:, None, :], float("-inf"))
    order = torch.sort(bound, dim=-1, descending=True, stable=True).indices
    top = min(retrieval.top_k, len(starts))
    chosen = order[..., :top]
    count = candidate.sum(-1)[:, None, None]  # candidates rank first
    chosen = chosen.masked_fill(torch.arange(top, device=k.device) >= count, -1)
    if top < retrieval.top_k:
        chosen = torch.cat((chosen, chosen.new_full((queries, kv_heads, retrieval.top_k - top),
                                                    -1)), dim=-1)
    return chosen


def _tile_keys(
    row: _Row, retrieval: Retrieval, chosen: Tensor, tile: slice, causal: bool,
) -> tuple[Tensor, Tensor]:
    """The keys one query tile reads and which query (per K/V head) may see which.

    Returns ``positions`` ``(keys,)`` (the sinks of the tile's documents, then the tokens of
    every block one of its queries chose) and ``allowed`` ``(tile, kv_heads, keys)`` bool.
    """
    device = row.lo.device
    lo, hi = row.lo[tile], row.hi[tile]
    query_doc = row.doc_start[row.offset + tile.start: row.offset + tile.stop]
    sink_parts = []
    if retrieval.sinks:
        for doc, end in torch.unique(
            torch.stack((query_doc, row.doc_end[row.offset + tile.start:
                                                row.offset + tile.stop])), dim=1).T.tolist():
            sink_parts.append(torch.arange(doc, min(doc + retrieval.sinks, end), device=device))
    sinks = torch.cat(sink_parts) if sink_parts else torch.zeros(0, dtype=torch.long,
                                                                  device=device)
    mine = chosen[tile]  # (tile, kv_heads, top_k)
    blocks = torch.unique(mine[mine >= 0])
    tokens = (row.block_start[blocks][:, None]
              + torch.arange(retrieval.block, device=device)).flatten()
    positions = torch.cat((sinks, tokens))
    sees_sink = (row.doc_start[sinks][None, :] == query_doc[:, None]) & (
        sinks[None, :] < lo[:, None])
    if not causal:
        sees_sink |= (row.doc_start[sinks][None, :] == query_doc[:, None]) & (
            sinks[None, :] >= hi[:, None])
    picked = (mine[..., None] == blocks).any(2)  # (tile, kv_heads, blocks)
    allowed = torch.cat(
        (sees_sink[:, None, :].expand(-1, mine.shape[1], -1),
         picked.repeat_interleave(retrieval.block, dim=-1)), dim=-1)
    return positions, allowed


def _tile_scores(q: Tensor, k: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """``(tile, kv_heads, group, keys)`` scores, ``-inf`` where not allowed; ``q`` ``(tile,
    kv_heads, group, dim)``, ``k`` ``(keys, kv_heads, dim)``."""
    scores = torch.einsum("nghd,sgd->nghs", q, k) * scale
    return scores.masked_fill(~allowed[:, :, None, :], float("-inf"))


class _RetrievalAttention(torch.autograd.Function):
    """Attention over the retrieval branches' keys of one batch element, given the selection;
    the backward recomputes each tile's scores (nothing but ``out`` and ``lse`` is kept)."""

    @staticmethod
    def forward(ctx, q, k, v, row, retrieval, chosen, causal, scale):
        compute = torch.promote_types(q.dtype, torch.float32)
        kv_heads = k.shape[1]
        out = q.new_zeros(q.shape, dtype=compute)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=compute)
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = _tile_keys(row, retrieval, chosen, tile, causal)
            if positions.numel() == 0:
                continue
            qt = rearrange(q[tile].to(compute), "n (g h) d -> n g h d", g=kv_heads)
            scores = _tile_scores(qt, k[positions].to(compute), allowed, scale)
            tile_lse = torch.logsumexp(scores, dim=-1)  # (n, g, h)
            probs = torch.exp(scores - tile_lse.nan_to_num(neginf=0.0)[..., None])
            tile_out = torch.einsum("nghs,sgd->nghd", probs, v[positions].to(compute))
            out[tile] = rearrange(tile_out, "n g h d -> n (g h) d")
            lse[tile] = rearrange(tile_lse, "n g h -> n (g h)")
        ctx.save_for_backward(q, k, v, out, lse, chosen)
        ctx.row, ctx.retrieval, ctx.causal, ctx.scale = row, retrieval, causal, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, chosen = ctx.saved_tensors
        compute, kv_heads = out.dtype, k.shape[1]
        dq = torch.zeros_like(q, dtype=compute)
        dk = torch.zeros_like(k, dtype=compute)
        dv = torch.zeros_like(v, dtype=compute)
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(compute)
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.to(compute)
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = _tile_keys(ctx.row, ctx.retrieval, chosen, tile, ctx.causal)
            if positions.numel() == 0:
                continue
            split = lambda t: rearrange(t, "n (g h) ... -> n g h ...", g=kv_heads)  # noqa: E731
            qt, ot, dot = split(q[tile].to(compute)), split(out[tile]), split(d_out[tile])
            kt, vt = k[positions].to(compute), v[positions].to(compute)
            tile_lse = split(lse[tile]).nan_to_num(neginf=0.0)
            probs = torch.exp(_tile_scores(qt, kt, allowed, ctx.scale) - tile_lse[..., None])
            d_probs = torch.einsum("nghd,sgd->nghs", dot, vt)
            delta = (dot * ot).sum(-1) - split(d_lse[tile])
            d_scores = probs * (d_probs - delta[..., None]) * ctx.scale
            dq[tile] = rearrange(torch.einsum("nghs,sgd->nghd", d_scores, kt),
                                 "n g h d -> n (g h) d")
            dk.index_add_(0, positions, torch.einsum("nghs,nghd->sgd", d_scores, qt))
            dv.index_add_(0, positions, torch.einsum("nghs,nghd->sgd", probs, dot))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def retrieval_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: DilatedPattern,
    retrieval: Retrieval,
    *,
    causal: bool,
    scale: float,
    documents: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor]:
    """The retrieval branches alone: ``(out, lse)`` over the keys the sinks and the selection
    give each query (module docstring), to be merged with the dilated branches by
    :func:`merge_attention`.

    Args:
        q: ``(batch, queries, heads, head_dim)``, the last ``queries`` positions of the keys
            (all of them in training; the new tokens when decoding against a cache).
        k, v: ``(batch, keys, kv_heads, head_dim)``, ``kv_heads`` dividing ``heads``; the query
            heads of one K/V head share its selection.
        pattern: the dilated pattern beside them (it fixes each query's local segment).
        documents: every batch element's document lengths (summing to ``keys``), or None for
            one document per element.
    Returns:
        ``out`` ``(batch, queries, heads, head_dim)`` in ``q``'s dtype and ``lse`` ``(batch,
        heads, queries)`` in float32 (float64 for float64 inputs); ``-inf`` and 0 where a query
        has no such key.
    """
    batch, queries = q.shape[:2]
    keys = k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        lengths = (keys,) if documents is None else tuple(documents[b])
        row = _row_geometry(lengths, queries, pattern, retrieval, q.device)
        chosen = select_blocks(q[b], k[b], row, retrieval, causal)
        out, lse = _RetrievalAttention.apply(q[b], k[b], v[b], row, retrieval, chosen, causal,
                                             scale)
        outs.append(out)
        lses.append(lse.T)
    return torch.stack(outs), torch.stack(lses)


def merge_attention(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor]:
    """One softmax from several key sets' ``(out, lse)`` (``out`` ``(batch, seq, heads,
    head_dim)``, ``lse`` ``(batch, heads, seq)``): ``out = sum_i exp(lse_i - lse) out_i``,
    ``lse = log sum_i exp(lse_i)``, differentiable; rows with no key anywhere give 0 and
    ``-inf``. Returns ``out`` in ``dtype`` and ``lse`` in the parts' dtype."""
    lses = torch.stack([lse for _, lse in parts])
    empty = torch.isneginf(lses).all(0)
    lses = lses.masked_fill(empty, 0.0)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).masked_fill(empty, 0.0)
    out = sum(rearrange(w, "b h n -> b n h 1") * o.to(w.dtype)
              for w, (o, _) in zip(weights.unbind(0), parts))
    return out.to(dtype), lse.masked_fill(empty, float("-inf"))
