"""The retrieval branches (neighbours, attention sinks, query-aware block selection) against
the loop reference of ``tests/reference.py``: outputs, ``lse`` and every gradient in float64 with a
random upstream gradient into both, and the selection itself, rule for rule."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import longnet.attention.retrieval as retrieval_module
import longnet.attention.selection as selection_module
from longnet.attention import DilatedPattern, Retrieval, dilated_attention
from longnet.attention.selection import block_bounds, row_geometry, select_blocks
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.nn import LayerKVCache, MultiheadDilatedAttention, RotaryEmbedding
from tests.reference import (
    dense_retrieval_attention,
    document_ids_of,
    per_document_reference,
    retrieval_selection,
)

PATTERN = [(8, 1), (16, 2), (32, 4)]

CASES = {
    # name: (seq, heads, kv_heads, branches, sinks, block, top_k, documents, neighbors)
    "sinks+select": (53, 4, 4, PATTERN, 2, 4, 3, None, 0),
    "select-gqa": (61, 4, 2, PATTERN, 0, 3, 2, None, 0),
    "sinks-only-gqa": (45, 6, 2, PATTERN, 3, 4, 0, None, 0),
    "top_k-beyond-blocks": (40, 2, 1, PATTERN, 1, 5, 50, None, 0),
    "short-no-past-block": (11, 2, 2, PATTERN, 2, 4, 2, None, 0),
    "no-rate-1-branch": (37, 4, 2, [(8, 2), (32, 4)], 2, 4, 2, None, 0),
    "sinks-longer-than-segment": (35, 2, 2, [(4, 1), (16, 2)], 6, 3, 2, None, 0),
    "packed": (60, 4, 2, PATTERN, 2, 4, 2, ((13, 30, 17), (60,)), 0),
    "neighbors+sinks+select": (71, 4, 2, PATTERN, 2, 3, 3, None, 1),
    "neighbors-only": (45, 4, 4, PATTERN, 0, 4, 0, None, 2),
    "neighbors-wider-than-the-row": (30, 2, 1, [(4, 1), (16, 2)], 3, 2, 4, None, 9),
    "neighbors-packed": (60, 4, 2, PATTERN, 2, 4, 2, ((13, 30, 17), (60,)), 1),
}


def _inputs(seq, heads, kv_heads, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, seq, kv_heads, 8, generator=gen, dtype=torch.float64)
            for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _reference(q, k, v, branches, causal, sinks, block, top_k, documents, neighbors=0):
    attend = functools.partial(_reference_one, sinks=sinks, block=block, top_k=top_k,
                               neighbors=neighbors)
    if documents is None:
        return attend(q, k, v, branches, causal)
    return per_document_reference(q, k, v, documents, branches, causal, attend=attend)


def _reference_one(q, k, v, branches, causal, *, sinks, block, top_k, neighbors):
    return dense_retrieval_attention(q, k, v, branches, causal, sinks, block, top_k,
                                     neighbors=neighbors)


@pytest.mark.parametrize("lse_gradient", [True, False], ids=["d_lse", "no-d_lse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference_with_gradients(case, causal, lse_gradient):
    """Without a gradient into ``lse`` the dilated part runs its fused kernels' backward with
    the merged ``out``/``lse``; with one, the math backward."""
    seq, heads, kv_heads, branches, sinks, block, top_k, documents, neighbors = CASES[case]
    batch = 1 if documents is None and case == "short-no-past-block" else 2
    q, k, v = _inputs(seq, heads, kv_heads, batch=batch)
    ids = None if documents is None else document_ids_of(documents)
    out, lse = dilated_attention(q, k, v, branches, causal=causal, return_lse=True,
                                 document_ids=ids,
                                 retrieval=Retrieval(sinks=sinks, block=block, top_k=top_k,
                                                     neighbors=neighbors))
    ref_out, ref_lse = _reference(q, k, v, branches, causal, sinks, block, top_k, documents,
                                  neighbors)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    d_lse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)

    def loss(out, lse):  # lse left out of the graph: no gradient reaches it, not zeros
        return (out * d_out).sum() + ((lse * d_lse).sum() if lse_gradient else 0)

    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=f"d{name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_own_query_and_key_rows_for_the_retrieval_branches(causal):
    """``retrieval_qk``: the sinks and blocks select and attend with their own rows (a key
    both parts give is two terms of the softmax, each with its part's score), the neighbours
    with ``q, k``; gradients reach q, k, v and both far tensors."""
    seq, heads, kv_heads, branches, sinks, block, top_k, _, _ = CASES["select-gqa"]
    q, k, v = _inputs(seq, heads, kv_heads)
    far_q, far_k, _ = _inputs(seq, heads, kv_heads, seed=5)
    out, lse = dilated_attention(q, k, v, branches, causal=causal, return_lse=True,
                                 retrieval=Retrieval(sinks=2, block=block, top_k=top_k,
                                                     neighbors=1),
                                 retrieval_qk=(far_q, far_k))
    ref_out, ref_lse = dense_retrieval_attention(q, k, v, branches, causal, 2, block, top_k,
                                                 far_q=far_q, far_k=far_k, neighbors=1)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    inputs = (q, k, v, far_q, far_k)
    grads = torch.autograd.grad((out * d_out).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * d_out).sum(), inputs)
    for name, got, want in zip(("q", "k", "v", "far_q", "far_k"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=f"d{name}")
    with pytest.raises(ValueError, match="without retrieval"):
        dilated_attention(q, k, v, branches, retrieval_qk=(far_q, far_k))
    with pytest.raises(ValueError, match="far_k must have the shape"):
        dilated_attention(q, k, v, branches, retrieval=Retrieval(sinks=2),
                          retrieval_qk=(far_q, far_q))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_small_query_chunks_and_tiles_give_the_same_result(causal, monkeypatch):
    """The selection scored in chunks of 7 queries and the neighbours and sinks attended in
    tiles of 5 (a chunk's own block range, tiles across segments and documents) give the
    reference's result."""
    seq, heads, kv_heads, branches, sinks, block, top_k, documents, neighbors = CASES[
        "neighbors-packed"]
    monkeypatch.setattr(selection_module, "SCORED_AT_ONCE", 7)
    monkeypatch.setattr(retrieval_module, "QUERY_TILE", 5)
    q, k, v = _inputs(seq, heads, kv_heads)
    out, lse = dilated_attention(q, k, v, branches, causal=causal, return_lse=True,
                                 document_ids=document_ids_of(documents),
                                 retrieval=Retrieval(sinks=sinks, block=block, top_k=top_k,
                                                     neighbors=neighbors))
    ref_out, ref_lse = _reference(q, k, v, branches, causal, sinks, block, top_k, documents,
                                  neighbors)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("neighbors", [0, 1])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_the_selection_is_the_rule(causal, neighbors):
    """Each query's chosen blocks, per K/V head, equal the loop reference's list exactly."""
    seq, heads, kv_heads, branches, sinks, block, top_k = 70, 4, 2, PATTERN, 2, 4, 3
    q, k, _ = _inputs(seq, heads, kv_heads)
    retrieval = Retrieval(sinks=sinks, block=block, top_k=top_k, neighbors=neighbors)
    want = retrieval_selection(q.detach(), k.detach(), branches, causal, sinks, block, top_k,
                               neighbors)
    pattern = DilatedPattern(branches)
    for b in range(2):
        row = row_geometry((seq,), seq, pattern, retrieval, q.device)
        chosen = select_blocks(q[b].detach(), block_bounds(k[b].detach(), row, retrieval), row,
                               retrieval, causal)
        for p in range(seq):
            for g in range(kv_heads):
                got = [(int(row.block_start[j]), int(row.block_end[j]))
                       for j in chosen[p, g] if j >= 0]
                assert sorted(got) == sorted(want[b, p, g]), (b, p, g)
    assert any(len(starts) == top_k for starts in want.values())


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_a_tie_goes_to_the_earlier_block(top_k):
    """Identical blocks score the same: the earliest win; a query with no candidate gets -1."""
    retrieval = Retrieval(block=2, top_k=top_k)
    k = torch.ones(16, 1, 4, dtype=torch.float64)
    k[10:12] = 2.0  # block 5 beats all others for the query at 15 (its segment starts at 12)
    q = torch.ones(16, 1, 4, dtype=torch.float64)
    row = row_geometry((16,), 16, DilatedPattern([(4, 1)]), retrieval, q.device)
    chosen = select_blocks(q, block_bounds(k, row, retrieval), row, retrieval, causal=True)
    assert sorted(chosen[15, 0].tolist()) == sorted([5, *range(top_k - 1)])
    assert sorted(chosen[7, 0].tolist()) == sorted([*range(min(top_k, 2)), *[-1] * (top_k - 2)])
    assert chosen[3, 0].tolist() == [-1] * top_k


def test_a_misaligned_far_needle_is_reached():
    """A key that no dilated branch gives the last query (wrong offset, far segment) becomes
    the one it attends to when its block is selected: the output is that key's value."""
    seq, block = 64, 4
    q = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    v = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    needle = 13  # offset 1 modulo 4 and 2; the last query sits at offset 3
    q[0, -1, 0] = torch.tensor([40.0, 0, 0, 0])
    k[0, needle, 0] = torch.tensor([1.0, 0, 0, 0])
    v[0, needle, 0] = torch.tensor([0.0, 7.0, 0, 0])
    branches = [(8, 1), (32, 2), (64, 4)]
    plain = dilated_attention(q, k, v, branches, causal=True)
    found = dilated_attention(q, k, v, branches, causal=True,
                              retrieval=Retrieval(block=block, top_k=1))
    assert plain[0, -1, 0, 1] < 0.01
    assert found[0, -1, 0, 1] > 6.9


def test_a_needle_just_before_the_local_segment_is_reached():
    """A needle in the last block before the query's segment (cut at the segment's start,
    so shorter than the others) is reached: no key before a segment is out of reach."""
    seq, block = 64, 4
    q = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    v = torch.zeros(1, seq, 1, 4, dtype=torch.float64)
    needle = 55  # blocks are cut from each segment's start: [50, 54), [54, 56) here; the
    # last query's segment is [56, 64)
    q[0, -1, 0] = torch.tensor([40.0, 0, 0, 0])
    k[0, needle, 0] = torch.tensor([1.0, 0, 0, 0])
    v[0, needle, 0] = torch.tensor([0.0, 7.0, 0, 0])
    found = dilated_attention(q, k, v, [(8, 1)], causal=True,
                              retrieval=Retrieval(sinks=2, block=block, top_k=1))
    assert found[0, -1, 0, 1] > 6.9


def test_no_retrieval_is_the_dilated_call():
    q, k, v = _inputs(40, 4, 2)
    want = dilated_attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), PATTERN,
                             causal=True)
    for retrieval in (None, Retrieval(), Retrieval(block=8, top_k=0)):
        assert torch.equal(dilated_attention(q, k, v, PATTERN, causal=True,
                                             retrieval=retrieval), want)


@pytest.mark.parametrize("kwargs, message", [
    ({"sinks": -1}, "sinks"),
    ({"block": 0}, "block"),
    ({"top_k": 1.5}, "top_k"),
    ({"neighbors": -1}, "neighbors"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Retrieval(**kwargs)


def test_neighbors_need_a_local_segment():
    q, k, v = _inputs(16, 2, 2)
    with pytest.raises(ValueError, match=r"neighbors=1.*has none; add a branch \(w, 1\)"):
        dilated_attention(q, k, v, [(8, 2)], retrieval=Retrieval(neighbors=1))
    with pytest.raises(ValueError, match="neighbors=2"):
        LongNetConfig(segment_lengths=(8,), dilation_rates=(2,), neighbor_segments=2)


def test_neighbors_give_the_previous_segment_densely():
    """With one neighbour a query at the start of its segment sees the whole previous
    segment: a key 7 positions back, in the segment before, becomes what it reads."""
    q = torch.zeros(1, 24, 1, 4, dtype=torch.float64)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    q[0, 16, 0, 0], k[0, 9, 0, 0], v[0, 9, 0, 1] = 40.0, 1.0, 7.0
    plain = dilated_attention(q, k, v, [(8, 1)], causal=True)
    found = dilated_attention(q, k, v, [(8, 1)], causal=True, retrieval=Retrieval(neighbors=1))
    assert plain[0, 16, 0, 1] == 0.0 and found[0, 16, 0, 1] > 6.9


def test_retrieval_must_be_a_retrieval():
    q, k, v = _inputs(16, 2, 2)
    with pytest.raises(TypeError, match="Retrieval"):
        dilated_attention(q, k, v, PATTERN, retrieval={"sinks": 4})


def test_bfloat16_is_close_to_float64(monkeypatch):
    """bfloat16 inputs against the float64 call on the same (rounded) values; tiles of one
    segment each, so the neighbours run the fused kernel."""
    monkeypatch.setattr(retrieval_module, "QUERY_TILE", 8)
    q, k, v = (t.detach().bfloat16() for t in _inputs(80, 4, 2))
    retrieval = Retrieval(sinks=2, block=4, top_k=3, neighbors=1)
    want = dilated_attention(q.double(), k.double(), v.double(), PATTERN, causal=True,
                             retrieval=retrieval)
    got = dilated_attention(q, k, v, PATTERN, causal=True, retrieval=retrieval)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want.detach(), rtol=0.05, atol=0.05)


def _retrieval_lm(**overrides):
    config = LongNetConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, max_positions=128, segment_lengths=(8, 16, 32),
                           dilation_rates=(1, 2, 4), position_encoding="rope",
                           attention_sinks=2, select_block=4, select_top_k=2, **overrides)
    torch.manual_seed(0)
    return LongNetLM(config).double().eval()


def _rotate(x, positions, theta=10000.0):
    """Split-half RoPE by hand, as complex numbers: ``x`` ``(batch, seq, heads, dim)`` turned
    by ``positions`` ``(seq,)`` times each pair's frequency (rounded to float32, the Llama
    convention the library keeps)."""
    half = x.shape[-1] // 2
    exponent = torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1]
    freqs = (1.0 / theta**exponent).double()
    turn = torch.polar(torch.ones(len(positions), half, dtype=torch.float64),
                       positions.double()[:, None] * freqs)[None, :, None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("pattern, sinks, block, neighbors", [
    (PATTERN, 2, 4, 0), (PATTERN, 6, 4, 0), ([(8, 2), (32, 4)], 2, 4, 0), (PATTERN, 2, 4, 2),
], ids=["window-8", "sinks-beyond-block", "no-rate-1-branch", "two-neighbors"])
def test_before_segment_places_each_far_block_before_the_reach_in_order(
    pattern, sinks, block, neighbors
):
    """``retrieval_positions="before_segment"`` equals, by hand: the dilated branches and the
    neighbours with keys rotated to their positions; the sinks and blocks with the query at
    ``p - segment start + neighbors * segment + max(block, sinks)`` and each key at its offset
    in its block (a sink at its position), so a far key at offset ``o`` is seen that many
    positions before the reach, in order."""
    torch.manual_seed(3)
    seq = 53
    attn = MultiheadDilatedAttention(
        32, 4, pattern, num_kv_heads=2, positional=RotaryEmbedding(8), bias=False,
        retrieval=Retrieval(sinks=sinks, block=block, top_k=2, neighbors=neighbors),
        retrieval_positions="before_segment").double()
    x = torch.randn(2, seq, 32, dtype=torch.float64)
    q = attn.q_proj(x).unflatten(-1, (4, 8))
    k = attn.k_proj(x).unflatten(-1, (2, 8))
    v = attn.v_proj(x).unflatten(-1, (2, 8))
    positions = torch.arange(seq)
    window = max((w for w, r in pattern if r == 1), default=None)
    into_segment = positions % window if window else torch.zeros(seq, dtype=torch.long)
    offsets = torch.tensor([t if t < sinks else  # a key's offset in its block (a sink: t)
                            (t - max(t // window * window if window else 0, sinks)) % block
                            for t in range(seq)])
    lead = max(block, sinks) + neighbors * (window or 0)
    out, _ = dense_retrieval_attention(
        _rotate(q, positions), _rotate(k, positions), v, pattern, True, sinks, block, 2,
        far_q=_rotate(q, into_segment + lead), far_k=_rotate(k, offsets), neighbors=neighbors)
    torch.testing.assert_close(attn(x), attn.out_proj(out.flatten(2)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("neighbors", [0, 1])
@pytest.mark.parametrize("rule", ["own", "before_segment"])
def test_cached_decoding_equals_the_full_forward(rule, neighbors):
    """Layer level: a prefill, single tokens and a chunk against the cache give the full
    forward's output; the cache keeps every key (the selection may read any past block), and
    with "before_segment" the keys as the retrieval branches score them."""
    torch.manual_seed(1)
    attn = MultiheadDilatedAttention(
        32, 4, PATTERN, num_kv_heads=2, positional=RotaryEmbedding(8),
        retrieval=Retrieval(sinks=2, block=4, top_k=2, neighbors=neighbors),
        retrieval_positions=rule).double()
    x = torch.randn(2, 75, 32, dtype=torch.float64)
    full = attn(x)
    cache = LayerKVCache()
    pieces = [attn(x[:, a:b], torch.arange(a, b), cache=cache)
              for a, b in [(0, 20), *[(i, i + 1) for i in range(20, 60)], (60, 75)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    assert cache.start == 0 and cache.end == 75
    assert (cache.far_key is None) == (rule == "own")


@pytest.mark.parametrize("rule", ["own", "before_segment"])
def test_greedy_generation_with_the_cache_equals_the_full_forward(rule):
    model = _retrieval_lm(retrieval_positions=rule, neighbor_segments=1)
    prompt = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(prompt, 70, temperature=0)
        uncached = model.generate(prompt, 70, temperature=0, use_cache=False)
        logits = model(generated).logits
    assert torch.equal(generated, uncached)
    assert torch.equal(generated[0, 9:], logits[0, 8:-1].argmax(-1))


def test_the_config_carries_the_branches(tmp_path):
    model = _retrieval_lm(neighbor_segments=1)
    branches = Retrieval(sinks=2, block=4, top_k=2, neighbors=1)
    assert model.model.layers[0].attn.retrieval == branches
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["select_top_k"], saved["neighbor_segments"]) == (2, 1)
    loaded = LongNetLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.config.retrieval == branches
    off = LongNetLM.from_pretrained(tmp_path, attention_sinks=0, select_top_k=0,
                                    neighbor_segments=0)
    assert off.config.retrieval is None and off.model.layers[0].attn.retrieval is None
    x = torch.randint(0, 50, (1, 70))
    with torch.no_grad():
        assert not torch.allclose(loaded(x).logits.float(), off(x).logits, atol=1e-4)


@pytest.mark.parametrize("fields, match", [
    ({"attention_sinks": -1}, "attention_sinks"),
    ({"select_block": 0}, "select_block"),
    ({"select_top_k": "4"}, "select_top_k"),
    ({"neighbor_segments": -1}, "neighbor_segments"),
    ({"retrieval_positions": "fixed", "attention_sinks": 2, "position_encoding": "rope"},
     "retrieval_positions"),
    ({"retrieval_positions": "before_segment", "position_encoding": "rope"}, "there are none"),
    ({"retrieval_positions": "before_segment", "attention_sinks": 2, "position_encoding": "xpos"},
     "needs rotary positions"),
])
def test_bad_config_fields_are_named(fields, match):
    with pytest.raises((TypeError, ValueError), match=match):
        LongNetConfig(**fields)


def test_gradient_checkpointing_gives_the_same_gradients():
    """The recomputed forward selects the same blocks: the gradients are those without it."""
    tokens = torch.randint(0, 50, (2, 71), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointing in (False, True):
        model = _retrieval_lm(retrieval_positions="before_segment",
                              gradient_checkpointing=checkpointing).train()
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=1e-10, atol=1e-12)
