"""Packed documents: ``dilated_attention(document_ids=...)`` equals the independent dense
reference applied to each document alone (outputs, lse and every gradient), float64."""

from __future__ import annotations

import random

import pytest
import torch

from longnet.attention import DilatedPattern, dilated_attention
from longnet.attention.blocks import BlockStack
from longnet.attention.plan import plan_attention
from tests.kernel_calls import count_kernel_calls
from tests.reference import document_ids_of, per_document_reference

TOL = 1e-12


def _inputs(batch, seq_len, heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=torch.float64)
        .requires_grad_()
        for _ in range(3)
    ]


def _grads(outputs, upstream, inputs):
    loss = sum((o * g).sum() for o, g in zip(outputs, upstream))
    return torch.autograd.grad(loss, inputs, retain_graph=True)


def assert_matches_documents(
    lengths_per_row, heads, branches, causal, *, seed=0, dim=8, block_elements=None,
    kernel="auto",
):
    """out, lse, and dq/dk/dv for a random upstream gradient into out (and into out and lse)
    equal the per-document reference to ``TOL``."""
    seq_len = sum(lengths_per_row[0])
    q, k, v = _inputs(len(lengths_per_row), seq_len, heads, dim, seed=seed)
    out, lse = dilated_attention(
        q, k, v, branches, causal=causal, return_lse=True,
        document_ids=document_ids_of(lengths_per_row), block_elements=block_elements,
        kernel=kernel,
    )
    ref_out, ref_lse = per_document_reference(q, k, v, lengths_per_row, branches, causal)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=TOL, rtol=0)

    gen = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0)
    for with_lse in (False, True):
        grads = _grads([out, lse.masked_fill(~finite, 0)][: 1 + with_lse], [d_out, d_lse],
                       (q, k, v))
        ref_grads = _grads([ref_out, ref_lse.masked_fill(~finite, 0)][: 1 + with_lse],
                           [d_out, d_lse], (q, k, v))
        for grad, ref_grad in zip(grads, ref_grads):
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)


# (name, document lengths per batch element, heads, branches)
CASES = [
    ("odd_lengths", [(7, 13, 1, 19)], 4, [(4, 1), (8, 2), (16, 4)]),
    ("shorter_than_a_segment", [(3, 5, 6, 2)], 4, [(8, 1), (16, 2)]),
    ("longer_than_several_segments", [(45, 38)], 4, [(4, 1), (8, 2), (12, 3)]),
    ("rows_differ_between_batch_elements", [(10, 30), (17, 5, 18), (40,)], 3,
     [(8, 1), (16, 2)]),
    ("same_documents_in_every_row", [(9, 24, 7), (9, 24, 7)], 4, [(6, 1), (12, 4)]),
    ("paper_rates_not_dividing", [(20, 33, 44)], 12, [(4, 1), (8, 2), (16, 4), (32, 6)]),
    ("no_unit_rate_uncovered_rows", [(11, 4, 15), (30,)], 3, [(6, 2), (15, 5)]),
    ("fewer_heads_than_rate", [(25, 15), (5, 35)], 3, [(8, 1), (40, 8)]),
    ("later_unit_rate", [(13, 32)], 4, [(4, 2), (8, 1), (16, 1)]),
    ("one_token_documents", [(1, 1, 2, 1, 5)], 2, [(2, 1), (4, 2)]),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name,lengths,heads,branches", CASES, ids=[c[0] for c in CASES])
def test_documents_match_per_document_reference(name, lengths, heads, branches, causal):
    assert_matches_documents(lengths, heads, branches, causal)


@pytest.mark.parametrize("block_elements", [1, 300])
@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
def test_tiny_block_budgets_and_every_kernel(block_elements, kernel):
    """Budgets below one block split groups into single segments of one head; stacks never
    exceed the budget unless a chunk alone does."""
    lengths = [(7, 20, 13), (16, 16, 8)]
    for causal in (False, True):
        assert_matches_documents(lengths, 4, [(4, 1), (8, 2), (32, 4)], causal,
                                 block_elements=block_elements, kernel=kernel)


@pytest.mark.parametrize("seed", range(20))
def test_random_documents_match_per_document_reference(seed):
    rng = random.Random(seed)
    seq_len, batch, heads = rng.randint(1, 70), rng.randint(1, 3), rng.randint(1, 6)
    rows = []
    for _ in range(batch):
        cuts = sorted(rng.sample(range(1, seq_len), min(rng.randint(0, 6), seq_len - 1)))
        rows.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, seq_len])))
    segment, branches = rng.randint(1, 6), []
    for _ in range(rng.randint(1, 4)):
        segment += rng.randint(1, 12)
        branches.append((segment, rng.randint(1, min(segment, 8))))
    budget = rng.choice([None, 64, 500])
    assert_matches_documents(rows, heads, branches, rng.random() < 0.5, seed=seed,
                             dim=rng.choice([4, 8]), block_elements=budget)


@pytest.mark.parametrize("causal", [False, True])
def test_one_document_per_row_is_the_plain_call(causal):
    q, k, v = _inputs(2, 50, 4, 8)
    branches = [(8, 1), (16, 2), (64, 4)]
    ids = torch.tensor([[4] * 50, [0] * 50])
    out, lse = dilated_attention(q, k, v, branches, causal=causal, return_lse=True,
                                 document_ids=ids)
    plain_out, plain_lse = dilated_attention(q, k, v, branches, causal=causal, return_lse=True)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    d_out = torch.randn_like(out)
    for grad, plain in zip(_grads([out], [d_out], (q, k, v)),
                           _grads([plain_out], [d_out], (q, k, v))):
        assert torch.equal(grad, plain)


def test_documents_of_one_shape_share_one_kernel_call_per_branch(monkeypatch):
    """The blocks of equally long documents, in any batch element, are stacked: one kernel
    call per branch each way, however many documents there are."""
    calls = count_kernel_calls(monkeypatch)
    for documents in (2, 4):
        calls.clear()
        lengths = (256 // documents,) * documents
        q, k, v = (torch.randn(3, 256, 4, 8, requires_grad=True) for _ in range(3))
        ids = document_ids_of([lengths, lengths, (256,)])  # the third row is one document
        out = dilated_attention(q, k, v, [(16, 1), (32, 2), (64, 4)], causal=True,
                                document_ids=ids, block_elements=2**30)
        out.sum().backward()
        assert len(calls) == 2 * 3, (documents, calls)


def test_stacks_stay_within_the_block_budget():
    """Every kernel call of a packed plan holds at most ``block_elements`` elements, unless it
    is one chunk that no split makes smaller (one segment of one head)."""
    lengths = ((300, 212, 300, 212), (1024,), (100,) * 10 + (24,))
    pattern = DilatedPattern((64, 128, 512), (1, 2, 4))
    for budget in (500, 5_000, 50_000):
        plan = plan_attention(pattern, (3, 1024, 4, 8), torch.float32,
                              torch.device("cpu"), causal=True, scale=0.3,
                              block_elements=budget, documents=lengths)
        stacks = 0
        for _, chunk in plan.chunks:
            groups = chunk.groups if isinstance(chunk, BlockStack) else (chunk,)
            stacks += isinstance(chunk, BlockStack)
            assert len({(len(g.heads), g.rows) for g in groups}) == 1
            size = sum(g.num_segments * len(g.heads) * g.rows * 8 for g in groups)
            assert size <= budget or (len(groups) == 1 and groups[0].num_segments == 1
                                      and len(groups[0].heads) == 1)
        assert stacks > 0


def test_document_ids_are_checked():
    q = torch.randn(2, 6, 2, 4)
    good = torch.zeros(2, 6, dtype=torch.long)
    cases = [
        (good[0], ValueError, r"document_ids has shape \(6,\), expected \(batch, seq\) = \(2, 6\)"),
        (good.float(), TypeError, "document_ids has dtype torch.float32; use an integer dtype"),
        (good.bool(), TypeError, "document_ids has dtype torch.bool"),
        ([[0] * 6] * 2, TypeError, "document_ids must be an integer torch.Tensor"),
        (torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 0, 2, 2]]), ValueError,
         "must not decrease along the sequence, but batch element 1 goes from 1 at position 2 "
         "to 0 at 3"),
        (good.to("meta"), ValueError, "document_ids is on meta but q on cpu; move it"),
    ]
    for ids, error, message in cases:
        with pytest.raises(error, match=message):
            dilated_attention(q, q, q, [(4, 1)], document_ids=ids)
