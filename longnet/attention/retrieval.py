"""The retrieval branches' attention (keys from ``selection``; docs/architecture.md §2): sinks
per query tile, each selected block with the queries that chose it (no K/V copy per query).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.op import dilated_attention_backward_op, dilated_attention_op
from longnet.attention.pattern import DilatedPattern
from longnet.attention.selection import Retrieval, Selection, block_rows, sink_keys

QUERY_TILE = 1024
"""Queries per tile of the sinks' attention."""


def _forward(q: Tensor, k: Tensor, v: Tensor, selection: Selection, retrieval: Retrieval,
             causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` ``(queries, heads, dim)``, ``(queries, heads)`` of one batch element."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group, row = q.shape[1] // k.shape[1], selection.row
    out = q.new_zeros(q.shape, dtype=compute)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=compute)
    if retrieval.sinks:
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = sink_keys(row, retrieval.sinks, tile, causal)
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
            keys = block_rows(row, j)
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
              selection: Selection, retrieval: Retrieval, causal: bool,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The retrieval branches' share of ``dq, dk, dv`` of one batch element, given the lse of
    all branches together and ``delta = rowsum(d_out * out) - d_lse``."""
    compute, group, row = lse.dtype, q.shape[1] // k.shape[1], selection.row
    dq = torch.zeros_like(q, dtype=compute)
    dk = torch.zeros_like(k, dtype=compute)
    dv = torch.zeros_like(v, dtype=compute)
    finite_lse = lse.nan_to_num(neginf=0.0)
    if retrieval.sinks:
        for first in range(0, q.shape[0], QUERY_TILE):
            tile = slice(first, min(first + QUERY_TILE, q.shape[0]))
            positions, allowed = sink_keys(row, retrieval.sinks, tile, causal)
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
            keys = block_rows(row, j)
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
    """``d_out`` (zeros for None) and ``rowsum(d_out * out) - d_lse`` in ``out``'s dtype."""
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
    """The dilated branches (the one-device op) and the retrieval branches (scoring with
    ``far_q, far_k``) as one softmax; each part's backward runs with the merged ``out``/``lse``.
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
    """``dilated_attention``'s one-device call with retrieval branches: ``(out, lse)``;
    ``op_args``: the op's arguments after ``q, k, v``; ``far_qk``: default ``q, k``."""
    far_q, far_k = (q, k) if far_qk is None else far_qk
    selections = [
        Selection.make(far_q[b].detach(), far_k[b].detach(),
                        (q.shape[1],) if documents is None else tuple(documents[b]),
                        pattern, retrieval, causal)
        for b in range(q.shape[0])
    ]
    return _DilatedWithRetrieval.apply(q, k, v, far_q, far_k, op_args, selections, retrieval,
                                       causal, scale)


def _scores(q: Tensor, k: Tensor, allowed: Tensor, group: int, scale: float) -> Tensor:
    """``(queries, heads, keys)`` scores, ``-inf`` where not ``allowed``; ``k`` grouped."""
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = rearrange(q.to(compute), "n (g h) d -> n g h d", h=group)
    scores = torch.einsum("nghd,sgd->nghs", qg, k.to(compute)) * scale
    return rearrange(scores, "n g h s -> n (g h) s").masked_fill(~allowed, float("-inf"))


def _values(weights: Tensor, v: Tensor, group: int) -> Tensor:
    """``weights`` ``(queries, heads, keys)`` times grouped ``v``: ``(queries, heads, dim)``."""
    weights = rearrange(weights, "n (g h) s -> n g h s", h=group)
    return rearrange(torch.einsum("nghs,sgd->nghd", weights, v.to(weights.dtype)),
                     "n g h d -> n (g h) d")


def _keys_grad(weights: Tensor, rows: Tensor, group: int) -> Tensor:
    """``weights^T rows`` summed over each K/V head's query heads: ``(keys, kv_heads, dim)``."""
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
    """The retrieval branches alone, to be merged with the dilated ones by :func:`merge_attention`.

    Args:
        q: ``(batch, queries, heads, head_dim)``, the last ``queries`` key positions.
        k, v: ``(batch, keys, kv_heads, head_dim)``, ``kv_heads`` dividing ``heads``; the query
            heads of one K/V head share its selection.
        pattern: the dilated pattern beside them (it fixes each query's local segment).
        documents: every batch element's document lengths (summing to ``keys``), or None for
            one document per element.
    Returns:
        ``out`` ``(batch, queries, heads, head_dim)`` in ``q``'s dtype and ``lse`` ``(batch,
        heads, queries)`` (accumulation dtype); 0 and ``-inf`` where a query has no such key.
    """
    batch, queries = q.shape[:2]
    keys = k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        lengths = (keys,) if documents is None else tuple(documents[b])
        selection = Selection.make(q[b].detach(), k[b].detach(), lengths, pattern, retrieval,
                                    causal)
        out, lse = _RetrievalAttention.apply(q[b], k[b], v[b], selection, retrieval, causal,
                                             scale)
        outs.append(out)
        lses.append(lse.T)
    return torch.stack(outs), torch.stack(lses)


def merge_attention(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor]:
    """One softmax from several key sets' ``(out, lse)`` (``(batch, seq, heads, head_dim)``,
    ``(batch, heads, seq)``), differentiable; rows with no key give 0 and ``-inf``."""
    lses = torch.stack([lse for _, lse in parts])
    empty = torch.isneginf(lses).all(0)
    lses = lses.masked_fill(empty, 0.0)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).masked_fill(empty, 0.0)
    out = sum(rearrange(w, "b h n -> b n h 1") * o.to(w.dtype)
              for w, (o, _) in zip(weights.unbind(0), parts))
    return out.to(dtype), lse.masked_fill(empty, float("-inf"))
