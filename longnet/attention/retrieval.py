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

The sinks are attended in query tiles (a tile reads its documents' sinks once); the selection
block by block (a chosen block attends to the queries that chose it, merged into their rows by
log-sum-exp): no copy of K/V is made per query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.op import dilated_attention_backward_op, dilated_attention_op
from longnet.attention.pattern import DilatedPattern
from longnet.validation import check_non_negative_int, check_positive_int

QUERY_TILE = 128
"""Queries per tile of the sinks' attention."""


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


SELECT_CHUNK = 4096
"""Queries scored at once by :func:`select_blocks` (bounds the ``(queries, kv_heads, blocks)``
score tensor)."""


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
        ``(queries, kv_heads, top_k)`` int64 block indices in no particular order, ``-1`` where
        a query has fewer candidates than ``top_k``.
    """
    queries, kv_heads = q.shape[0], k.shape[1]
    starts = row.block_start
    chosen = q.new_full((queries, kv_heads, retrieval.top_k), -1, dtype=torch.long)
    if retrieval.top_k == 0 or len(starts) == 0:
        return chosen
    compute = torch.promote_types(q.dtype, torch.float32)
    members = k[starts[:, None] + torch.arange(retrieval.block, device=k.device)].to(compute)
    low, high = members.amin(1), members.amax(1)  # (blocks, kv_heads, dim)
    ends = starts + retrieval.block
    for first in range(0, queries, SELECT_CHUNK):
        part = slice(first, min(first + SELECT_CHUNK, queries))
        # causal: only the blocks ending before the chunk's last local segment can be chosen
        blocks = (len(starts) if not causal else
                  int(torch.searchsorted(ends, row.lo[part].max(), right=True)))
        top = min(retrieval.top_k, blocks)
        if top == 0:
            continue
        qg = rearrange(q[part].to(compute), "n (g h) d -> n g h d", g=kv_heads)
        bound = (torch.einsum("ngd,jgd->ngj", qg.clamp(min=0).sum(2), high[:blocks])
                 + torch.einsum("ngd,jgd->ngj", qg.clamp(max=0).sum(2), low[:blocks]))
        candidate = _candidates(row, starts[:blocks], retrieval.block, part, causal)[:, None]
        bound = bound.masked_fill(~candidate, float("-inf"))
        # The top_k highest, ties to the earlier block: every block above the k-th highest
        # bound, then the earliest of those equal to it.
        kth = torch.topk(bound, top, dim=-1).values[..., -1:]
        tied = (bound == kth) & candidate
        wanted = top - (bound > kth).sum(-1, keepdim=True)
        picked = ((bound > kth) | (tied & (tied.cumsum(-1) <= wanted))) & candidate
        earlier = torch.arange(blocks, 0, -1, device=k.device)  # larger for earlier blocks
        order = torch.topk(picked * earlier, top, dim=-1)
        chosen[part, :, :top] = order.indices.masked_fill(order.values == 0, -1)
    return chosen


def _candidates(row: _Row, starts: Tensor, block: int, part: slice, causal: bool) -> Tensor:
    """``(queries, blocks)`` bool: the complete blocks of each query's document outside its
    local segment (before it when ``causal``)."""
    same = row.doc_start[starts][None, :] == row.doc_start[row.offset + part.start:
                                                           row.offset + part.stop][:, None]
    outside = (starts + block)[None, :] <= row.lo[part, None]
    if not causal:
        outside |= starts[None, :] >= row.hi[part, None]
    return same & outside


def _sink_keys(row: _Row, sinks: int, tile: slice, causal: bool) -> tuple[Tensor, Tensor]:
    """The sinks one query tile reads: ``positions`` ``(keys,)``, the first ``sinks`` tokens of
    each document of the tile's queries, and ``allowed`` ``(tile, keys)`` bool, which query
    may see which (same document, outside its local segment, before it when causal)."""
    device = row.lo.device
    keys = slice(row.offset + tile.start, row.offset + tile.stop)
    query_doc = row.doc_start[keys]
    parts = [torch.arange(doc, min(doc + sinks, end), device=device) for doc, end in
             torch.unique(torch.stack((query_doc, row.doc_end[keys])), dim=1).T.tolist()]
    positions = torch.cat(parts)
    same = row.doc_start[positions][None, :] == query_doc[:, None]
    allowed = same & (positions[None, :] < row.lo[tile, None])
    if not causal:
        allowed |= same & (positions[None, :] >= row.hi[tile, None])
    return positions, allowed


def _block_queries(chosen: Tensor, blocks: int) -> list[list[tuple[int, Tensor]]]:
    """For each K/V head, the blocks some query chose, with those queries: ``[(block,
    queries (count,) int64), ...]`` in block order (a query chooses a block at most once)."""
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
class _Selection:
    """One batch element's retrieval geometry and choice: its :class:`_Row`, the chosen
    blocks ``(queries, kv_heads, top_k)`` and, per K/V head, each chosen block's queries."""

    row: _Row
    chosen: Tensor
    block_queries: list[list[tuple[int, Tensor]]]

    @classmethod
    def make(cls, q: Tensor, k: Tensor, lengths: Sequence[int], pattern: DilatedPattern,
             retrieval: Retrieval, causal: bool) -> _Selection:
        """The selection of one batch element: ``q`` ``(queries, heads, dim)``, ``k`` ``(keys,
        kv_heads, dim)``, its documents' ``lengths``."""
        row = _row_geometry(lengths, q.shape[0], pattern, retrieval, q.device)
        chosen = select_blocks(q, k, row, retrieval, causal)
        return cls(row, chosen, _block_queries(chosen, len(row.block_start)))


def _forward(q: Tensor, k: Tensor, v: Tensor, selection: _Selection, retrieval: Retrieval,
             causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one batch element over the retrieval branches' keys, in the compute
    dtype: ``(queries, heads, dim)`` and ``(queries, heads)``.

    The sinks run in query tiles (a tile reads its documents' sinks, masked per query); the
    selection block by block: each chosen block attends to the queries that chose it, merged
    into their rows by log-sum-exp, so no key is gathered per query.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    group, row = q.shape[1] // k.shape[1], selection.row
    out = q.new_zeros(q.shape, dtype=compute)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=compute)
    if retrieval.sinks:
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = _sink_keys(row, retrieval.sinks, tile, causal)
            scores = _scores(q[tile], k[positions], allowed[:, None, :], group, scale)
            tile_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - tile_lse.nan_to_num(neginf=0.0)[..., None])
            out[tile] = _values(probs, v[positions], group)
            lse[tile] = tile_lse
    for g, blocks in enumerate(selection.block_queries):
        heads = slice(g * group, (g + 1) * group)
        q_g, k_g, v_g = q[:, heads].to(compute), k[:, g].to(compute), v[:, g].to(compute)
        out_g, lse_g = out[:, heads].contiguous(), lse[:, heads].contiguous()
        for j, queries in blocks:
            keys = _block_rows(row, retrieval, j)
            scores = torch.einsum("nhd,sd->nhs", q_g.index_select(0, queries), k_g[keys]) * scale
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.einsum("nhs,sd->nhd", torch.exp(scores - block_lse[..., None]),
                                     v_g[keys])
            old_lse = lse_g.index_select(0, queries)
            new_lse = torch.logaddexp(old_lse, block_lse)
            merged = (out_g.index_select(0, queries) * torch.exp(old_lse - new_lse)[..., None]
                      + block_out * torch.exp(block_lse - new_lse)[..., None])
            out_g.index_copy_(0, queries, merged)
            lse_g.index_copy_(0, queries, new_lse)
        out[:, heads], lse[:, heads] = out_g, lse_g
    return out, lse


def _backward(d_out: Tensor, delta: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor,
              selection: _Selection, retrieval: Retrieval, causal: bool,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The retrieval branches' share of ``dq, dk, dv`` (compute dtype) of one batch element,
    given the softmax's ``lse`` ``(queries, heads)`` (of all branches together: the
    flash-attention identity) and ``delta = rowsum(d_out * out) - d_lse``."""
    compute, group, row = lse.dtype, q.shape[1] // k.shape[1], selection.row
    dq = torch.zeros_like(q, dtype=compute)
    dk = torch.zeros_like(k, dtype=compute)
    dv = torch.zeros_like(v, dtype=compute)
    finite_lse = lse.nan_to_num(neginf=0.0)
    if retrieval.sinks:
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = _sink_keys(row, retrieval.sinks, tile, causal)
            scores = _scores(q[tile], k[positions], allowed[:, None, :], group, scale)
            probs = torch.exp(scores - finite_lse[tile, :, None])
            grads = _score_grads(probs, d_out[tile], v[positions], delta[tile], group, scale)
            dq[tile] = _values(grads, k[positions], group)
            dk.index_add_(0, positions, _keys_grad(grads, q[tile], group))
            dv.index_add_(0, positions, _keys_grad(probs, d_out[tile], group))
    for g, blocks in enumerate(selection.block_queries):
        heads = slice(g * group, (g + 1) * group)
        q_g, k_g, v_g = q[:, heads].to(compute), k[:, g].to(compute), v[:, g].to(compute)
        d_out_g, lse_g, delta_g = d_out[:, heads], finite_lse[:, heads], delta[:, heads]
        dq_g = torch.zeros_like(q_g)
        for j, queries in blocks:
            keys = _block_rows(row, retrieval, j)
            q_rows, d_rows = q_g.index_select(0, queries), d_out_g.index_select(0, queries)
            probs = torch.exp(torch.einsum("nhd,sd->nhs", q_rows, k_g[keys]) * scale
                              - lse_g.index_select(0, queries)[..., None])
            d_probs = torch.einsum("nhd,sd->nhs", d_rows, v_g[keys])
            grads = probs * (d_probs - delta_g.index_select(0, queries)[..., None]) * scale
            dq_g.index_add_(0, queries, torch.einsum("nhs,sd->nhd", grads, k_g[keys]))
            dk[keys, g] += torch.einsum("nhs,nhd->sd", grads, q_rows)
            dv[keys, g] += torch.einsum("nhs,nhd->sd", probs, d_rows)
        dq[:, heads] += dq_g
    return dq, dk, dv


def _delta(d_out: Tensor | None, d_lse: Tensor | None, out: Tensor) -> tuple[Tensor, Tensor]:
    """``d_out`` (zeros for None) and ``rowsum(d_out * out) - d_lse`` in ``out``'s dtype;
    ``out`` ``(..., heads, dim)``, ``d_lse`` ``(..., heads)`` or None."""
    d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype)
    delta = (d_out * out).sum(-1)
    return d_out, delta if d_lse is None else delta - d_lse.to(out.dtype)


class _RetrievalAttention(torch.autograd.Function):
    """The retrieval branches alone on one batch element, given the selection."""

    @staticmethod
    def forward(ctx, q, k, v, selection, retrieval, causal, scale):
        out, lse = _forward(q, k, v, selection, retrieval, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = selection, retrieval, causal, scale
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        d_out, delta = _delta(d_out, d_lse, out)
        dq, dk, dv = _backward(d_out, delta, q, k, v, lse, *ctx.call)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _DilatedWithRetrieval(torch.autograd.Function):
    """The dilated branches (the one-device op) and the retrieval branches as one softmax.

    The retrieval branches score with their own rows ``far_q, far_k`` (``q, k`` themselves
    unless a position rule rotates them differently). Forward: both parts' ``(out, lse)``,
    merged by log-sum-exp. Backward: each part's backward run with the merged ``out`` and
    ``lse`` (the flash-attention identity: its exact share of the gradient), so the dilated
    part keeps its fused kernels' backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, far_q, far_k, op_args, selections, retrieval, causal, scale):
        group = q.shape[2] // k.shape[2]
        k_all, v_all = (t.repeat_interleave(group, dim=2) for t in (k, v))
        near_out, near_lse = dilated_attention_op(q, k_all, v_all, *op_args)
        fars = [_forward(far_q[b], far_k[b], v[b], s, retrieval, causal, scale)
                for b, s in enumerate(selections)]
        far_out = torch.stack([out for out, _ in fars])
        far_lse = rearrange(torch.stack([lse for _, lse in fars]), "b n h -> b h n")
        out, lse = merge_attention(((near_out, near_lse), (far_out, far_lse)), q.dtype)
        ctx.save_for_backward(q, k, v, far_q, far_k, out, lse)
        ctx.call = op_args, selections, retrieval, causal, scale
        ctx.set_materialize_grads(False)  # no gradient into lse: the fused kernels' backward
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, far_q, far_k, out, lse = ctx.saved_tensors
        op_args, selections, retrieval, causal, scale = ctx.call
        group = q.shape[2] // k.shape[2]
        if d_out is None:
            d_out = torch.zeros_like(out)
        k_all, v_all = (t.repeat_interleave(group, dim=2) for t in (k, v))
        dq, dk, dv = dilated_attention_backward_op(d_out, d_lse, q, k_all, v_all, out, lse,
                                                   *op_args)
        dq, dk, dv = (t.to(lse.dtype) for t in (dq, dk, dv))
        dk, dv = (rearrange(t, "b n (g h) d -> b n g h d", h=group).sum(3) for t in (dk, dv))
        d_rows, delta = _delta(d_out, None if d_lse is None else
                               rearrange(d_lse, "b h n -> b n h"), out.to(lse.dtype))
        d_far_q, d_far_k = torch.zeros_like(dq), torch.zeros_like(dk)
        for b, selection in enumerate(selections):
            grads = _backward(d_rows[b], delta[b], far_q[b], far_k[b], v[b], lse[b].T,
                              selection, retrieval, causal, scale)
            for total, grad in zip((d_far_q, d_far_k, dv), grads):
                total[b] += grad
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_far_q.to(far_q.dtype),
                d_far_k.to(far_k.dtype), *(None,) * 5)


def dilated_with_retrieval(
    q: Tensor, k: Tensor, v: Tensor, op_args: tuple, pattern: DilatedPattern,
    retrieval: Retrieval, *, causal: bool, scale: float,
    documents: Sequence[Sequence[int]] | None, far_qk: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``dilated_attention``'s one-device call with the retrieval branches: ``(out, lse)`` of
    the one softmax over both parts' keys. ``op_args``: the arguments of
    ``longnet::dilated_attention`` after ``q, k, v``; ``k, v`` may have grouped heads;
    ``far_qk``: the rows the retrieval branches score with (default ``q, k``), of their
    shapes."""
    far_q, far_k = (q, k) if far_qk is None else far_qk
    selections = [
        _Selection.make(far_q[b].detach(), far_k[b].detach(),
                        (q.shape[1],) if documents is None else tuple(documents[b]),
                        pattern, retrieval, causal)
        for b in range(q.shape[0])
    ]
    return _DilatedWithRetrieval.apply(q, k, v, far_q, far_k, op_args, selections, retrieval,
                                       causal, scale)


def _block_rows(row: _Row, retrieval: Retrieval, block: int) -> slice:
    """The key positions of block ``block``."""
    start = int(row.block_start[block])
    return slice(start, start + retrieval.block)


def _scores(q: Tensor, k: Tensor, allowed: Tensor, group: int, scale: float) -> Tensor:
    """``(queries, heads, keys)`` scores in the compute dtype, ``-inf`` where not ``allowed``
    (broadcast to that shape); ``q`` ``(queries, heads, dim)``, ``k`` ``(keys, kv_heads, dim)``."""
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = rearrange(q.to(compute), "n (g h) d -> n g h d", h=group)
    scores = torch.einsum("nghd,sgd->nghs", qg, k.to(compute)) * scale
    return rearrange(scores, "n g h s -> n (g h) s").masked_fill(~allowed, float("-inf"))


def _values(weights: Tensor, v: Tensor, group: int) -> Tensor:
    """``weights`` ``(queries, heads, keys)`` times ``v`` ``(keys, kv_heads, dim)``: ``(queries,
    heads, dim)``."""
    weights = rearrange(weights, "n (g h) s -> n g h s", h=group)
    return rearrange(torch.einsum("nghs,sgd->nghd", weights, v.to(weights.dtype)),
                     "n g h d -> n (g h) d")


def _keys_grad(weights: Tensor, rows: Tensor, group: int) -> Tensor:
    """``weights`` ``(queries, heads, keys)`` transposed times ``rows`` ``(queries, heads, dim)``,
    summed over each K/V head's query heads: ``(keys, kv_heads, dim)``."""
    weights = rearrange(weights, "n (g h) s -> n g h s", h=group)
    rows = rearrange(rows.to(weights.dtype), "n (g h) d -> n g h d", h=group)
    return torch.einsum("nghs,nghd->sgd", weights, rows)


def _score_grads(probs: Tensor, d_out: Tensor, v: Tensor, delta: Tensor, group: int,
                 scale: float) -> Tensor:
    """The gradient of the scaled scores: ``probs * (d_out . v - delta) * scale``."""
    d_probs = rearrange(
        torch.einsum("nghd,sgd->nghs", rearrange(d_out, "n (g h) d -> n g h d", h=group),
                     v.to(probs.dtype)), "n g h s -> n (g h) s")
    return probs * (d_probs - delta[..., None]) * scale


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
        selection = _Selection.make(q[b].detach(), k[b].detach(), lengths, pattern, retrieval,
                                    causal)
        out, lse = _RetrievalAttention.apply(q[b], k[b], v[b], selection, retrieval, causal,
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
