"""The retrieval branches' attention (keys from ``selection``; docs/architecture.md §2):
neighbours and sinks per query tile, each selected block with the queries that chose it (no
K/V copy per query). Neighbours score with the dilated branches' ``q, k``; sinks and blocks
with ``far_q, far_k`` (a rotary model's ``retrieval_positions``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from longnet.attention.kernels import select_kernel
from longnet.attention.op import dilated_attention_backward_op, dilated_attention_op
from longnet.attention.pattern import DilatedPattern
from longnet.attention.selection import (
    Retrieval,
    Selection,
    neighbor_keys,
    select,
    sink_keys,
)

QUERY_TILE = 1024
"""Queries per tile of the neighbours' and sinks' attention."""


def _tile_keys(queries: int, selection: Selection, retrieval: Retrieval, causal: bool,
               keys: range):
    """``(tile, near, rows, allowed)`` for each query tile and key set given per tile: the
    neighbours (``near``: scored with ``q, k``) and the sinks (with ``far_q, far_k``), those at
    positions in ``keys``, ``rows`` counted from its start."""
    for first in range(0, queries, QUERY_TILE):
        tile = slice(first, min(first + QUERY_TILE, queries))
        sets = []
        if retrieval.neighbors:
            sets.append((True, *neighbor_keys(selection.row, tile, causal)))
        if retrieval.sinks:
            sets.append((False, *sink_keys(selection.row, retrieval.sinks, tile, causal)))
        for near, positions, allowed in sets:
            inside = (positions >= keys.start) & (positions < keys.stop)
            yield tile, near, positions[inside] - keys.start, allowed[:, inside]


def _block_keys(selection: Selection, blocks: list[tuple[int, Tensor]], keys: range):
    """``(rows, queries)`` of the chosen ``blocks`` ``[(block, queries), ...]`` with keys at
    positions in ``keys``, ``rows`` the slice of those keys counted from its start."""
    starts, ends = selection.row.block_start.tolist(), selection.row.block_end.tolist()
    for j, queries in blocks:
        first, stop = max(starts[j], keys.start), min(ends[j], keys.stop)
        if first < stop:
            yield slice(first - keys.start, stop - keys.start), queries


def accumulate_(out: Tensor, lse: Tensor, rows: slice | Tensor, part_out: Tensor,
                part_lse: Tensor) -> None:
    """Merge one key set's ``(part_out, part_lse)`` into ``out[rows], lse[rows]`` in place."""
    old_lse = lse[rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    finite = new_lse.nan_to_num(neginf=0.0)  # rows without any key yet stay 0 and -inf
    out[rows] = (out[rows] * torch.exp(old_lse - finite)[..., None]
                 + part_out * torch.exp(part_lse - finite)[..., None])
    lse[rows] = new_lse


def retrieval_forward(q: Tensor, k: Tensor, v: Tensor, far_q: Tensor, far_k: Tensor,
                      selection: Selection, retrieval: Retrieval, causal: bool, scale: float,
                      keys_from: int = 0) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` ``(queries, heads, dim)``, ``(queries, heads)`` of one batch element's
    queries against its keys ``k, v, far_k`` ``(keys, kv_heads, dim)`` at the positions from
    ``keys_from`` (all keys on one device; one rank's shard under sequence parallelism)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group, keys = q.shape[1] // k.shape[1], range(keys_from, keys_from + k.shape[0])
    out = q.new_zeros(q.shape, dtype=compute)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=compute)
    for tile, near, positions, allowed in _tile_keys(q.shape[0], selection, retrieval, causal,
                                                     keys):
        rows_q, rows_k = (q, k) if near else (far_q, far_k)
        if not bool(allowed.any()):
            continue
        if bool(allowed.all()):  # every query of the tile sees every key: a fused kernel
            tile_out, tile_lse = _unmasked(rows_q[tile], rows_k[positions], v[positions], scale)
            accumulate_(out, lse, tile, tile_out.to(compute), tile_lse.to(compute))
            continue
        scores = _scores(rows_q[tile], rows_k[positions], allowed[:, None, :], group, scale)
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - tile_lse.nan_to_num(neginf=0.0)[..., None])
        accumulate_(out, lse, tile, _values(probs, v[positions], group), tile_lse)
    for g, blocks in enumerate(selection.block_queries):
        heads = slice(g * group, (g + 1) * group)
        q_g, k_g, v_g = far_q[:, heads].to(compute), far_k[:, g].to(compute), v[:, g].to(compute)
        out_g, lse_g = out[:, heads].contiguous(), lse[:, heads].contiguous()
        for rows, queries in _block_keys(selection, blocks, keys):
            scores = torch.einsum("nhd,sd->nhs", q_g.index_select(0, queries), k_g[rows]) * scale
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.einsum("nhs,sd->nhd", torch.exp(scores - block_lse[..., None]),
                                     v_g[rows])
            accumulate_(out_g, lse_g, queries, block_out, block_lse)
        out[:, heads], lse[:, heads] = out_g, lse_g
    return out, lse


def retrieval_backward(d_out: Tensor, delta: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       far_q: Tensor, far_k: Tensor, lse: Tensor, selection: Selection,
                       retrieval: Retrieval, causal: bool, scale: float,
                       keys_from: int = 0) -> tuple[Tensor, ...]:
    """The retrieval branches' share of ``dq, dk, d_far_q, d_far_k, dv`` of one batch element
    (keys as in :func:`retrieval_forward`), given the ``lse`` its softmax is normalised by
    and ``delta = rowsum(d_out * out) - d_lse``."""
    compute, group = lse.dtype, q.shape[1] // k.shape[1]
    keys = range(keys_from, keys_from + k.shape[0])
    grads_qk = {near: (torch.zeros_like(q, dtype=compute), torch.zeros_like(k, dtype=compute))
                for near in (True, False)}
    dv = torch.zeros_like(v, dtype=compute)
    finite_lse = lse.nan_to_num(neginf=0.0)
    for tile, near, positions, allowed in _tile_keys(q.shape[0], selection, retrieval, causal,
                                                     keys):
        rows_q, rows_k = (q, k) if near else (far_q, far_k)
        dq, dk = grads_qk[near]
        scores = _scores(rows_q[tile], rows_k[positions], allowed[:, None, :], group, scale)
        probs = torch.exp(scores - finite_lse[tile, :, None])
        grads = _score_grads(probs, d_out[tile], v[positions], delta[tile], group, scale)
        dq[tile] += _values(grads, rows_k[positions], group)
        dk.index_add_(0, positions, _keys_grad(grads, rows_q[tile], group))
        dv.index_add_(0, positions, _keys_grad(probs, d_out[tile], group))
    d_far_q, d_far_k = grads_qk[False]  # the blocks score with the far rows
    for g, blocks in enumerate(selection.block_queries):
        heads = slice(g * group, (g + 1) * group)
        q_g, k_g, v_g = far_q[:, heads].to(compute), far_k[:, g].to(compute), v[:, g].to(compute)
        d_out_g, lse_g, delta_g = d_out[:, heads], finite_lse[:, heads], delta[:, heads]
        dq_g = torch.zeros_like(q_g)
        for rows, queries in _block_keys(selection, blocks, keys):
            q_rows, d_rows = q_g.index_select(0, queries), d_out_g.index_select(0, queries)
            probs = torch.exp(torch.einsum("nhd,sd->nhs", q_rows, k_g[rows]) * scale
                              - lse_g.index_select(0, queries)[..., None])
            d_probs = torch.einsum("nhd,sd->nhs", d_rows, v_g[rows])
            grads = probs * (d_probs - delta_g.index_select(0, queries)[..., None]) * scale
            dq_g.index_add_(0, queries, torch.einsum("nhs,sd->nhd", grads, k_g[rows]))
            d_far_k[rows, g] += torch.einsum("nhs,nhd->sd", grads, q_rows)
            dv[rows, g] += torch.einsum("nhs,nhd->sd", probs, d_rows)
        d_far_q[:, heads] += dq_g
    return *grads_qk[True], d_far_q, d_far_k, dv


def output_delta(d_out: Tensor | None, d_lse: Tensor | None,
                 out: Tensor) -> tuple[Tensor, Tensor]:
    """``d_out`` (zeros for None) and ``rowsum(d_out * out) - d_lse`` in ``out``'s dtype."""
    d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype)
    delta = (d_out * out).sum(-1)
    return d_out, delta if d_lse is None else delta - d_lse.to(out.dtype)


class _DilatedWithRetrieval(torch.autograd.Function):
    """The dilated branches (the one-device op) and the retrieval branches (scoring with
    ``far_q, far_k``) as one softmax; each part's backward runs with the merged ``out``/``lse``.
    """

    @staticmethod
    def forward(ctx, q, k, v, far_q, far_k, op_args, selections, retrieval, causal, scale):
        group = q.shape[2] // k.shape[2]
        k_all, v_all = (t.repeat_interleave(group, dim=2) for t in (k, v))
        near_out, near_lse = dilated_attention_op(q, k_all, v_all, *op_args)
        fars = [retrieval_forward(q[b], k[b], v[b], far_q[b], far_k[b], s, retrieval, causal,
                                  scale)
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
        d_rows, delta = output_delta(d_out, None if d_lse is None else
                               rearrange(d_lse, "b h n -> b n h"), out.to(lse.dtype))
        d_far_q, d_far_k = torch.zeros_like(dq), torch.zeros_like(dk)
        for b, selection in enumerate(selections):
            grads = retrieval_backward(d_rows[b], delta[b], q[b], k[b], v[b], far_q[b], far_k[b],
                              lse[b].T, selection, retrieval, causal, scale)
            for total, grad in zip((dq, dk, d_far_q, d_far_k, dv), grads):
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
        select(far_q[b].detach(), far_k[b].detach(),
               (q.shape[1],) if documents is None else tuple(documents[b]), pattern, retrieval,
               causal)
        for b in range(q.shape[0])
    ]
    return _DilatedWithRetrieval.apply(q, k, v, far_q, far_k, op_args, selections, retrieval,
                                       causal, scale)


def _unmasked(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` ``(queries, heads, dim)``, ``(queries, heads)`` of ``q`` against every
    key of ``k, v`` ``(keys, kv_heads, dim)``, by the device's fused kernel (forward only: the
    backward recomputes the scores)."""
    kernel = select_kernel(q.device, q.dtype, q.shape[-1])
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out, lse = kernel.forward(*(rearrange(t, "n h d -> 1 h n d") for t in (q, k, v)), False,
                              scale)[:2]
    return rearrange(out, "1 h n d -> n h d"), rearrange(lse, "1 h n -> n h")


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
    far_qk: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The retrieval branches alone, to be merged with the dilated ones by :func:`merge_attention`
    (KV-cache decoding; gradients, if asked for, through plain torch ops).

    Args:
        q: ``(batch, queries, heads, head_dim)``, the last ``queries`` key positions.
        k, v: ``(batch, keys, kv_heads, head_dim)``, ``kv_heads`` dividing ``heads``; the query
            heads of one K/V head share its selection.
        pattern: the dilated pattern beside them (it fixes each query's local segment).
        documents: every batch element's document lengths (summing to ``keys``), or None for
            one document per element.
        far_qk: ``(far_q, far_k)`` like ``q, k`` that the sinks and blocks score with
            (default ``q, k``).
    Returns:
        ``out`` ``(batch, queries, heads, head_dim)`` in ``q``'s dtype and ``lse`` ``(batch,
        heads, queries)`` (accumulation dtype); 0 and ``-inf`` where a query has no such key.
    """
    batch, queries = q.shape[:2]
    keys = k.shape[1]
    far_q, far_k = (q, k) if far_qk is None else far_qk
    outs, lses = [], []
    for b in range(batch):
        lengths = (keys,) if documents is None else tuple(documents[b])
        selection = select(far_q[b].detach(), far_k[b].detach(), lengths, pattern, retrieval,
                           causal)
        out, lse = retrieval_forward(q[b], k[b], v[b], far_q[b], far_k[b], selection, retrieval,
                                     causal, scale)
        outs.append(out.to(q.dtype))
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
