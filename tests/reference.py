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
