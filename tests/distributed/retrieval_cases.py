"""Worker bodies for the retrieval branches under sequence parallelism: every rank builds the
same global float64 inputs, runs its shard (contiguous or zigzag) and compares out, lse and
the gradients of q, k, v (and of the far rows, when given) with the single-device call and
with the loop reference of ``tests/reference.py``; then a rotary attention layer with the
branches at ``retrieval_positions="before_segment"`` against the single-device layer, on both
layouts."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longnet.attention import Retrieval, dilated_attention
from longnet.distributed.layouts import shard_positions
from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.nn import MultiheadDilatedAttention, RotaryEmbedding
from tests.distributed.ring_cases import (
    TOL,
    check_layer_on_shards,
    collect_failure,
    run_with_gradients,
    tags_forced_to_zero,
)
from tests.reference import dense_retrieval_attention, document_ids_of, per_document_reference


def retrieval_cases(world_size: int) -> list[dict]:
    """Shards of 12 (7 for one): local segments spanning ranks, blocks crossing shard
    boundaries, sinks on the first rank only, neighbours reaching into the previous rank,
    grouped-query attention, packed documents spanning ranks, own far rows, ``top_k`` beyond
    the blocks there are, no rate-1 branch, zigzag shards; both directions, half with a
    gradient into lse."""
    n = 12 * world_size
    cases = {
        # name: (shard, heads, kv_heads, branches, Retrieval(sinks, block, top_k, neighbors),
        #        documents, far rows)
        "sinks+select": (12, 4, 4, [(6, 1), (12, 2), (n, 4)], Retrieval(2, 5, 3), None, False),
        "gqa+neighbours": (12, 4, 2, [(4, 1), (n, 3)], Retrieval(2, 3, 2, 1), None, False),
        "window-spanning-ranks": (12, 2, 1, [(24, 1)], Retrieval(1, 5, 2, 1), None, False),
        "far-rows": (12, 4, 2, [(6, 1), (24, 2)], Retrieval(1, 5, 2), None, True),
        "packed": (12, 4, 2, [(4, 1), (12, 2)], Retrieval(2, 3, 2, 1), _documents(n), False),
        "top_k-beyond-blocks": (7, 2, 1, [(7, 1), (14, 2)], Retrieval(1, 3, 50, 2), None,
                                False),
        "no-rate-1-branch": (12, 4, 2, [(6, 2), (n, 4)], Retrieval(2, 4, 2), None, False),
        # zigzag: stripes of 6, rank r holding stripes r and 2P - 1 - r
        "zigzag": (12, 4, 2, [(6, 1), (n, 3)], Retrieval(2, 4, 2, 1), None, False),
        "zigzag-far-rows": (12, 4, 2, [(3, 1), (12, 2)], Retrieval(1, 5, 3, 2), None, True),
    }
    return [dict(name=f"{name}-{'causal' if causal else 'bidir'}", shard=shard, heads=heads,
                 kv_heads=kv_heads, branches=branches, retrieval=retrieval, documents=documents,
                 far_rows=far_rows, causal=causal, lse_grad=(index + causal) % 2 == 0,
                 layout="zigzag" if name.startswith("zigzag") else "contiguous")
            for index, (name, (shard, heads, kv_heads, branches, retrieval, documents, far_rows))
            in enumerate(cases.items())
            for causal in (True, False)]


def _documents(n: int) -> list[tuple[int, ...]]:
    """Two rows of packed documents over ``n`` tokens: one cut at odd places, one whole."""
    cuts = [0, 5, n // 2 + 3, n - 4, n]
    return [tuple(b - a for a, b in zip(cuts, cuts[1:])), (n,)]


def check_retrieval_cases(rank: int, world_size: int, device: torch.device) -> list[str]:
    """Run every case, then the first two again with every tag forced to 0, then the layer;
    return descriptions of the failures."""
    failures: list[str] = []
    cases = retrieval_cases(world_size)
    for seed, case in enumerate(cases):
        collect_failure(failures, case["name"], _check_case, rank, world_size, device, case,
                        seed)
    with tags_forced_to_zero():
        for seed, case in enumerate(cases[:2]):
            collect_failure(failures, f"tags forced to 0: {case['name']}", _check_case, rank,
                            world_size, device, case, seed)
    for layout in ("contiguous", "zigzag"):
        collect_failure(failures, f"rotary layer with retrieval branches, {layout}",
                        _check_layer, rank, world_size, device, layout)
    return failures


def _check_case(rank: int, world_size: int, device: torch.device, case: dict, seed: int) -> None:
    n, causal, retrieval = case["shard"] * world_size, case["causal"], case["retrieval"]
    gen = torch.Generator().manual_seed(seed)
    q, far_q, d_out = (torch.randn(2, n, case["heads"], 8, generator=gen, dtype=torch.float64)
                       for _ in range(3))
    k, v, far_k = (torch.randn(2, n, case["kv_heads"], 8, generator=gen, dtype=torch.float64)
                   for _ in range(3))
    tensors = (q, k, v, far_q, far_k) if case["far_rows"] else (q, k, v)
    attend = functools.partial(_reference, branches=case["branches"], causal=causal,
                               retrieval=retrieval, documents=case["documents"])
    _, ref_lse = attend(*tensors)
    d_lse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)
    d_lse = d_lse.masked_fill(ref_lse.isinf(), 0) if case["lse_grad"] else None
    shard = shard_positions(n, rank, world_size, case["layout"])
    ids = None if case["documents"] is None else document_ids_of(case["documents"])

    def library(sequence_parallel, rows):
        def call(q, k, v, *far):
            return dilated_attention(
                q, k, v, case["branches"], causal=causal, return_lse=True,
                sequence_parallel=sequence_parallel, retrieval=retrieval,
                retrieval_qk=tuple(far) if far else None,
                document_ids=None if ids is None else ids[:, rows].to(q.device))
        return call

    everything = slice(None)
    ring = run_with_gradients([t[:, shard].to(device) for t in tensors], d_out[:, shard],
                None if d_lse is None else d_lse[..., shard],
                library(SequenceParallel(dist.group.WORLD, case["layout"]), shard))
    single = run_with_gradients(tensors, d_out, d_lse, library(None, everything))
    reference = run_with_gradients(tensors, d_out, d_lse, attend)
    names = ("out", "lse", "dq", "dk", "dv", "d_far_q", "d_far_k")
    for name, mine, one, ref in zip(names, ring, single, reference):
        index = (Ellipsis, shard) if name == "lse" else (slice(None), shard)
        for label, expected in (("single-device", one[index]), ("loop reference", ref[index])):
            same_inf = torch.equal(torch.isneginf(mine), torch.isneginf(expected))
            error = (mine - expected).nan_to_num(0, 0, 0).abs().max().item()
            assert same_inf and error <= TOL, (
                f"rank {rank}: {name} vs {label}: max error {error:.2e}")


def _reference(q, k, v, far_q=None, far_k=None, *, branches, causal, retrieval, documents):
    """The loop reference's ``(out, lse)``: one document per row, or each packed one alone."""
    def one(q, k, v, branches, causal, far_q=None, far_k=None):
        return dense_retrieval_attention(q, k, v, branches, causal, retrieval.sinks,
                                         retrieval.block, retrieval.top_k, far_q=far_q,
                                         far_k=far_k, neighbors=retrieval.neighbors)
    if documents is None:
        return one(q, k, v, branches, causal, far_q, far_k)
    assert far_q is None, "the packed cases score with q, k"
    return per_document_reference(q, k, v, documents, branches, causal, attend=one)


def _check_layer(rank: int, world_size: int, device: torch.device, layout: str) -> None:
    """A causal ``MultiheadDilatedAttention`` with rotary positions, sinks, block selection and
    a neighbour, the far rows rotated ``"before_segment"``, on this rank's shard (the default
    positions of the ``layout``) equals the single-device layer: output, input gradient and
    (summed over ranks) every parameter's."""
    torch.manual_seed(12)
    n = 12 * world_size
    attn = MultiheadDilatedAttention(
        24, 4, [(6, 1), (n, 3)], num_kv_heads=2, positional=RotaryEmbedding(6), causal=True,
        retrieval=Retrieval(sinks=2, block=3, top_k=2, neighbors=1),
        retrieval_positions="before_segment",
    ).double()
    check_layer_on_shards(attn, n, rank, world_size, device, layout)
