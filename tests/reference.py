"""An independent dense reference for LongNet dilated attention (docs/architecture.md §2).

Written from the spec with explicit loops over branches, segments and heads; it shares no code
with ``longnet.attention``. ``out = softmax(q k^T * scale + log C) v`` where ``C[h, p, t]`` counts
the branches that give query ``p`` the key ``t`` for head ``h``.
"""

from __future__ import annotations

import torch


def branch_counts(seq_len: int, num_heads: int, branches, causal: bool) -> torch.Tensor:
    """``(heads, seq, seq)`` multiplicity ``C`` built by enumerating every segment."""
    counts = torch.zeros(num_heads, seq_len, seq_len, dtype=torch.float64)
    for w, r in branches:
        for start in range(0, seq_len, w):
            segment = torch.arange(start, min(start + w, seq_len))
            for head in range(num_heads):
                chosen = segment[(segment - start) % r == head % r]
                counts[head, chosen[:, None], chosen[None, :]] += 1
    if causal:
        counts = counts.tril()
    return counts


def copy_visibility(query: int, key: int, branches, num_heads: int) -> str:
    """What gives the query at ``query`` the key at ``key``, from the spec's rules: a branch
    ``(w, r)`` does when both lie in one segment (``// w``), at one offset (``% r``), and a
    head has that offset (heads take offsets ``h % r``: the first ``num_heads`` of them).
    ``"dense"``: a rate-1 branch does; ``"sparse"``: only branches of higher rates; ``"unseen"``:
    none."""
    rates = [r for w, r in branches
             if query // w == key // w and (query - key) % r == 0 and query % r < num_heads]
    return "dense" if 1 in rates else "sparse" if rates else "unseen"


def dense_dilated_attention(q, k, v, branches, causal: bool, scale: float | None = None):
    """Reference ``out`` ``(batch, seq, heads, dim)`` and ``lse`` ``(batch, heads, seq)``.

    Rows with no key give ``out = 0`` and ``lse = -inf``; gradients are finite everywhere.
    """
    _, seq_len, num_heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    counts = branch_counts(seq_len, num_heads, branches, causal).to(q.device)
    scores = torch.einsum("bphd,bthd->bhpt", q, k) * scale + counts.clamp(min=1).log()
    scores = scores.masked_fill(counts == 0, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse[..., None])
    return torch.einsum("bhpt,bthd->bphd", probs, v), lse


def document_ids_of(lengths_per_row):
    """``(batch, seq)`` ids from each batch element's document lengths (ids need not start at
    0 nor be consecutive: only their runs matter)."""
    rows = []
    for row, lengths in enumerate(lengths_per_row):
        ids = [3 * row + 2 * doc for doc, length in enumerate(lengths) for _ in range(length)]
        rows.append(ids)
    return torch.tensor(rows)


def per_document_reference(q, k, v, lengths_per_row, branches, causal,
                           attend=dense_dilated_attention):
    """``attend`` (default ``dense_dilated_attention``; any function of ``(q, k, v, branches,
    causal)`` returning its ``(out, lse)``) on every document alone (sliced out of its batch
    element), put back in place: ``out`` ``(batch, seq, heads, dim)``, ``lse`` ``(batch, heads,
    seq)``."""
    outs, lses = [], []
    for row, lengths in enumerate(lengths_per_row):
        start, row_out, row_lse = 0, [], []
        for length in lengths:
            part = slice(start, start + length)
            out, lse = attend(
                q[row : row + 1, part], k[row : row + 1, part], v[row : row + 1, part],
                branches, causal,
            )
            row_out.append(out)
            row_lse.append(lse)
            start += length
        outs.append(torch.cat(row_out, dim=1))
        lses.append(torch.cat(row_lse, dim=2))
    return torch.cat(outs), torch.cat(lses)


def retrieval_selection(q, k, branches, causal: bool, sinks: int, block: int, top_k: int,
                        neighbors: int = 0):
    """The blocks each query selects, from the spec with explicit loops: ``{(b, p, g): [block
    starts, best first]}`` for one document per batch row (``k`` with ``kv_heads`` heads).

    Blocks of ``block`` tokens are cut from the start of each segment of the largest rate-1
    branch (from ``sinks`` in the first), a segment's last block shorter; without a rate-1
    branch, from ``sinks`` over the whole document, complete blocks only (:func:`blocks_of`).
    A candidate lies outside the query's reach (the largest rate-1 branch's segment holding
    ``p`` with ``neighbors`` segments on each side, else ``p`` alone), before it when causal.
    Its score is the sum over the group's query heads and channels of ``max(q_c * min_t k_c,
    q_c * max_t k_c)``; the highest ``top_k`` win, the earlier block on a tie. Returned as
    ``(start, end)`` pairs."""
    batch, seq_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    dense = [w for w, r in branches if r == 1]
    chosen = {}
    for b in range(batch):
        for p in range(seq_len):
            lo, hi = reach(p, seq_len, dense, neighbors)
            starts = [(s, e) for s, e in blocks_of(seq_len, dense, sinks, block)
                      if e <= lo or (not causal and s >= hi)]
            for g in range(kv_heads):
                scores = {}
                for s, e in starts:
                    keys = k[b, s:e, g]
                    total = 0.0
                    for h in range(g * group, (g + 1) * group):
                        for c in range(head_dim):
                            low, high = keys[:, c].min(), keys[:, c].max()
                            total += float(max(q[b, p, h, c] * low, q[b, p, h, c] * high))
                    scores[s, e] = total
                chosen[b, p, g] = sorted(starts, key=lambda s: (-scores[s], s))[:top_k]
    return chosen


def blocks_of(seq_len: int, dense_segments, sinks: int, block: int) -> list[tuple[int, int]]:
    """The selectable blocks ``(start, end)`` of a document of ``seq_len`` tokens."""
    if not dense_segments:
        return [(s, s + block) for s in range(sinks, seq_len - block + 1, block)]
    w = max(dense_segments)
    found = []
    for segment in range(0, seq_len, w):
        stop = min(segment + w, seq_len)
        found += [(s, min(s + block, stop)) for s in range(max(segment, sinks), stop, block)]
    return found


def local_segment(p: int, seq_len: int, dense_segments) -> tuple[int, int]:
    """``[lo, hi)``: the segment of the largest rate-1 branch holding ``p``, or ``p`` alone."""
    if not dense_segments:
        return p, p + 1
    w = max(dense_segments)
    return p // w * w, min(p // w * w + w, seq_len)


def reach(p: int, seq_len: int, dense_segments, neighbors: int) -> tuple[int, int]:
    """``[lo, hi)``: the local segment holding ``p`` widened by ``neighbors`` segments a side."""
    lo, hi = local_segment(p, seq_len, dense_segments)
    if not dense_segments:
        return lo, hi
    w = max(dense_segments)
    return max(0, lo - neighbors * w), min(seq_len, hi + neighbors * w)


def dense_retrieval_attention(q, k, v, branches, causal: bool, sinks: int, block: int,
                              top_k: int, scale: float | None = None, far_q=None, far_k=None,
                              neighbors: int = 0):
    """Reference ``(out, lse)`` of the dilated branches plus the neighbours, the sinks and the
    block selection, one softmax over the multiset union of their keys, for one document per
    batch row; ``k, v`` may have fewer heads than ``q`` (grouped-query attention). The
    neighbours (the keys of the query's reach outside its local segment, before it when
    causal) score with ``q, k`` like the dilated branches; sinks and blocks with ``far_q,
    far_k`` (default ``q, k``). Each key a branch gives is a term of its own."""
    batch, seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    far_q = q if far_q is None else far_q
    far_k = k if far_k is None else far_k
    near = branch_counts(seq_len, num_heads, branches, causal).repeat(batch, 1, 1, 1)
    far = torch.zeros_like(near)
    dense = [w for w, r in branches if r == 1]
    for p in range(seq_len):
        lo, hi = local_segment(p, seq_len, dense)
        reach_lo, reach_hi = reach(p, seq_len, dense, neighbors)
        for t in range(seq_len):
            if reach_lo <= t < lo or (not causal and hi <= t < reach_hi):
                near[:, :, p, t] += 1
        for t in range(min(sinks, seq_len)):
            if t < reach_lo or (not causal and t >= reach_hi):
                far[:, :, p, t] += 1
    selection = retrieval_selection(far_q.detach(), far_k.detach(), branches, causal, sinks,
                                    block, top_k, neighbors)
    for (b, p, g), starts in selection.items():
        for s, e in starts:
            far[b, g * group : (g + 1) * group, p, s:e] += 1
    expand = lambda t: t.repeat_interleave(group, dim=2)  # noqa: E731
    terms = []
    for counts, queries, keys in ((near, q, expand(k)), (far, far_q, expand(far_k))):
        scores = torch.einsum("bphd,bthd->bhpt", queries, keys) * scale
        terms.append((scores + counts.clamp(min=1).log()).masked_fill(counts == 0, float("-inf")))
    scores = torch.cat(terms, dim=-1)  # (batch, heads, seq, 2 * seq): near keys, then far
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse[..., None])
    return torch.einsum("bhpt,bthd->bphd", probs, torch.cat((expand(v), expand(v)), 1)), lse
