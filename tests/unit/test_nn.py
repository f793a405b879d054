"""Unit tests of longnet.nn: positional encodings, attention layer, KV cache, FFN, blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from longnet.attention import DilatedPattern
from longnet.nn import (
    MLP,
    CausalShortConv,
    GatedMLP,
    LayerKVCache,
    LearnedPositionalEmbedding,
    MultiheadDilatedAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    XPos,
    build_norm,
    multiplicity_attention,
)
from tests.reference import dense_dilated_attention

F64 = torch.float64


def _qk(batch=2, seq=24, heads=3, kv_heads=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, dtype=F64, generator=g)
    k = torch.randn(batch, seq, kv_heads, dim, dtype=F64, generator=g)
    return q, k


def test_rmsnorm_matches_formula_and_upcasts():
    norm = RMSNorm(6, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 6, dtype=F64)
    ref = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref, rtol=0, atol=1e-14)
    norm_bf16 = RMSNorm(6).to(torch.bfloat16)
    assert norm_bf16(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="norm"):
        build_norm("batchnorm", 4, 1e-5)


@pytest.mark.parametrize("kind", ["rope", "xpos"])
def test_positional_shard_equals_slice_of_full(kind):
    """Encoding a shard with its global positions equals the shard of the full encoding."""
    enc = RotaryEmbedding(8) if kind == "rope" else XPos(8, block_size=16, scale_base=8.0)
    q, k = _qk(seq=40, kv_heads=1)
    full_q, full_k = enc(q, k, torch.arange(40))
    for start, stop in [(0, 13), (13, 29), (29, 40)]:
        part_q, part_k = enc(q[:, start:stop], k[:, start:stop], torch.arange(start, stop))
        torch.testing.assert_close(part_q, full_q[:, start:stop], rtol=0, atol=1e-12)
        torch.testing.assert_close(part_k, full_k[:, start:stop], rtol=0, atol=1e-12)
    # (batch, seq) position ids give the same result as the shared (seq,) ones
    batched_q, _ = enc(q, k, torch.arange(40).expand(2, 40))
    torch.testing.assert_close(batched_q, full_q, rtol=0, atol=0)


def _scores(q, k):
    return torch.einsum("bnhd,bmhd->bhnm", q, k)


def test_rope_scores_depend_only_on_distance():
    rope = RotaryEmbedding(8, theta=100.0)
    q, k = _qk(seq=10, heads=2, kv_heads=2)
    a = _scores(*rope(q, k, torch.arange(10)))
    b = _scores(*rope(q, k, torch.arange(10) + 37))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    assert not torch.allclose(a, _scores(q, k))


def test_xpos_is_rope_times_distance_decay():
    """xPos score(n, m) = sum over rotary pairs i of zeta_i ** ((n - m) / gamma) * pair score."""
    head_dim, gamma, block = 8, 4.0, 16
    xpos = XPos(head_dim, block_size=block, scale_base=gamma)
    rope = RotaryEmbedding(head_dim)
    q, k = _qk(batch=1, seq=block, heads=1, kv_heads=1)
    pos = torch.arange(block)
    xq, xk = xpos(q, k, pos)
    rq, rk = rope(q, k, pos)
    half = head_dim // 2
    pair = torch.einsum("bnhi,bmhi->bhnmi", rq[..., :half], rk[..., :half]) + torch.einsum(
        "bnhi,bmhi->bhnmi", rq[..., half:], rk[..., half:]
    )
    zeta = (torch.arange(0, head_dim, 2, dtype=F64) + 0.4 * head_dim) / (1.4 * head_dim)
    dist = (pos[:, None] - pos[None, :]).to(F64)
    decay = zeta ** (dist[..., None] / gamma)  # (n, m, i)
    expected = (pair * decay).sum(-1)
    torch.testing.assert_close(_scores(xq, xk), expected, rtol=1e-10, atol=1e-10)
    # the decay makes far keys count less: |zeta|<1 for every pair
    assert bool((zeta < 1).all())
    # shifting every position by a whole block leaves the scores unchanged
    torch.testing.assert_close(
        _scores(*xpos(q, k, pos + 3 * block)), _scores(xq, xk), rtol=1e-10, atol=1e-10
    )


def test_xpos_refuses_unnested_pattern_and_float16_overflow():
    xpos = XPos(8, block_size=12)
    with pytest.raises(ValueError, match="divide"):
        xpos.check_pattern(DilatedPattern((8, 12), (1, 2)))
    big = XPos(8, block_size=32768, scale_base=512.0)
    q, k = _qk(seq=4)
    with pytest.raises(ValueError, match="float16"):
        big(q.half(), k.half(), torch.arange(4))
    q2, _ = big(q.float(), k.float(), torch.arange(4))  # float32 is fine
    assert torch.isfinite(q2).all()


def test_learned_positions_refuse_out_of_range():
    emb = LearnedPositionalEmbedding(8, 4)
    assert emb(torch.arange(8)).shape == (8, 4)
    with pytest.raises(ValueError, match="positions"):
        emb(torch.arange(9))


def _dense_reference(attn: MultiheadDilatedAttention, x, pos, causal):
    """Independent dense computation: projections, repeat_interleave K/V, RoPE, SDPA."""
    h, hk = attn.num_heads, attn.num_kv_heads
    q = rearrange(attn.q_proj(x), "b n (h d) -> b n h d", h=h)
    k = rearrange(attn.k_proj(x), "b n (h d) -> b n h d", h=hk)
    v = rearrange(attn.v_proj(x), "b n (h d) -> b n h d", h=hk)
    if attn.positional is not None:
        q, k = attn.positional(q, k, pos)
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return attn.out_proj(rearrange(out, "b h n d -> b n (h d)"))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_dense_pattern_matches_sdpa_with_grouped_heads(causal):
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(
        24, 4, [(32, 1)], causal=causal, num_kv_heads=2, positional=RotaryEmbedding(6)
    ).double()
    x = torch.randn(2, 20, 24, dtype=F64)
    pos = torch.arange(20)
    torch.testing.assert_close(
        attn(x, pos), _dense_reference(attn, x, pos, causal), rtol=1e-10, atol=1e-10
    )


def test_attention_dilated_matches_explicit_multiplicity_formula():
    torch.manual_seed(1)
    pattern = DilatedPattern((4, 8, 16), (1, 2, 4))
    attn = MultiheadDilatedAttention(32, 4, pattern, causal=True, num_kv_heads=2).double()
    x = torch.randn(2, 37, 32, dtype=F64)
    out = attn(x)
    q = rearrange(attn.q_proj(x), "b n (h d) -> b n h d", h=4)
    k = rearrange(attn.k_proj(x), "b n (h d) -> b n h d", h=2).repeat_interleave(2, dim=2)
    v = rearrange(attn.v_proj(x), "b n (h d) -> b n h d", h=2).repeat_interleave(2, dim=2)
    ref, _ = dense_dilated_attention(q, k, v, pattern.branches, causal=True, scale=attn.scale)
    ref = attn.out_proj(rearrange(ref, "b n h d -> b n (h d)"))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def _shifted_sum(x, weight, history=None):
    """``y[t] = sum_j weight[:, j] * x[t - j]`` written as a sum of shifted copies, the rows
    before ``x`` taken from ``history`` (zeros when None)."""
    width = weight.shape[1] - 1
    if history is None:
        history = torch.zeros(x.shape[0], width, x.shape[2], dtype=x.dtype)
    rows = torch.cat((history, x), dim=1)
    n = x.shape[1]
    return sum(weight[:, j] * rows[:, width - j : width - j + n] for j in range(width + 1))


def test_short_conv_matches_shifted_sum_with_and_without_history():
    torch.manual_seed(7)
    conv = CausalShortConv(6, 4).double()
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(2, 9, 6, dtype=F64, requires_grad=True)
    history = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    for hist in (None, history):
        out = conv(x, hist)
        ref = _shifted_sum(x, conv.weight, hist)
        upstream = torch.randn_like(out)
        inputs = [x, conv.weight] + ([hist] if hist is not None else [])
        grads = torch.autograd.grad(out, inputs, upstream)
        ref_grads = torch.autograd.grad(ref, inputs, upstream)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    fresh = CausalShortConv(6, 4).double()
    torch.testing.assert_close(fresh(x), x)  # starts as the identity
    with pytest.raises(ValueError, match="history"):
        conv(x, history[:, :2])
    with pytest.raises(ValueError, match="kv_conv_size"):
        MultiheadDilatedAttention(16, 2, [(8, 1)], kv_conv_size=1)


def test_attention_with_kv_conv_matches_reference_outputs_and_gradients():
    """Projections, shifted-sum convolution of k and v, dense dilated reference: equal
    outputs and gradients (input and every parameter) under a random upstream gradient."""
    torch.manual_seed(8)
    pattern = DilatedPattern((4, 8, 16), (1, 2, 4))
    attn = MultiheadDilatedAttention(
        32, 4, pattern, causal=True, num_kv_heads=2, positional=RotaryEmbedding(8),
        kv_conv_size=4,
    ).double()
    with torch.no_grad():
        attn.kv_conv.weight.normal_()
    x = torch.randn(2, 37, 32, dtype=F64, requires_grad=True)
    pos = torch.arange(37)

    def reference():
        q = rearrange(attn.q_proj(x), "b n (h d) -> b n h d", h=4)
        kv = _shifted_sum(torch.cat((attn.k_proj(x), attn.v_proj(x)), -1), attn.kv_conv.weight)
        k = rearrange(kv[..., :16], "b n (h d) -> b n h d", h=2)
        v = rearrange(kv[..., 16:], "b n (h d) -> b n h d", h=2)
        q, k = attn.positional(q, k, pos)
        k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
        out, _ = dense_dilated_attention(q, k, v, pattern.branches, causal=True, scale=attn.scale)
        return attn.out_proj(rearrange(out, "b n h d -> b n (h d)"))

    inputs = [x, *attn.parameters()]
    out, ref = attn(x, pos), reference()
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, upstream)
    ref_grads = torch.autograd.grad(ref, inputs, upstream)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_multiplicity_attention_matches_the_reference(causal):
    """The library's explicit formula (the decoding path) against the independent oracle of
    tests/reference.py: queries at the last positions, keys from the earliest segment start
    those queries can see (as ``MultiheadDilatedAttention`` windows its KV cache)."""
    pattern = DilatedPattern((4, 8, 16), (1, 2, 4))
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 37, 4, 8, dtype=F64, generator=gen) for _ in range(3))
    ref, _ = dense_dilated_attention(q, k, v, pattern.branches, causal=causal, scale=0.3)
    first = 30
    start = min((first // w) * w for w in pattern.segment_lengths)
    out = multiplicity_attention(
        q[:, first:], k[:, start:], v[:, start:], torch.arange(first, 37),
        torch.arange(start, 37), pattern, causal=causal, scale=0.3,
    )
    torch.testing.assert_close(out, ref[:, first:], rtol=1e-10, atol=1e-10)


def test_multiplicity_attention_query_without_keys_outputs_zero():
    # no branch has rate 1: for head 0 odd positions are never selected
    pattern = DilatedPattern((4, 8), (2, 2))
    q, k = _qk(batch=1, seq=8, heads=2, kv_heads=2)
    pos = torch.arange(8)
    out = multiplicity_attention(q, k, k, pos, pos, pattern, causal=True, scale=0.5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1::2, 0], torch.zeros_like(out[0, 1::2, 0]))
    assert out[0, 0::2, 0].abs().sum() > 0


@pytest.mark.parametrize(
    ("positional", "kv_conv_size"), [("rope", 0), ("xpos", 0), (None, 0), ("rope", 3)]
)
def test_cached_chunks_equal_full_run_and_cache_stays_bounded(positional, kv_conv_size):
    """The last shard computed with the earlier tokens' K/V (the cache) equals the full run;
    with a K/V convolution (random taps), its tail carries over between chunks."""
    torch.manual_seed(2)
    pattern = DilatedPattern((4, 8, 16), (1, 2, 4))
    enc = {"rope": RotaryEmbedding(8), "xpos": XPos(8, block_size=16, scale_base=8.0)}
    attn = MultiheadDilatedAttention(
        32, 4, pattern, causal=True, num_kv_heads=2, positional=enc.get(positional),
        kv_conv_size=kv_conv_size,
    ).double()
    if attn.kv_conv is not None:
        with torch.no_grad():
            attn.kv_conv.weight.normal_()
    x = torch.randn(2, 53, 32, dtype=F64)
    full = attn(x)
    cache = LayerKVCache()
    pieces, sizes = [], []
    for start, stop in [(0, 11), (11, 30), *[(i, i + 1) for i in range(30, 45)], (45, 53)]:
        pieces.append(attn(x[:, start:stop], torch.arange(start, stop), cache=cache))
        sizes.append(len(cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.end == 53 and max(sizes[2:]) <= 2 * 16
    assert cache.start == 48  # keys before the current largest segment were dropped


def test_cache_rejects_non_contiguous_positions_and_bidirectional_layers():
    attn = MultiheadDilatedAttention(16, 2, [(8, 1)], causal=True)
    cache = LayerKVCache()
    attn(torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(ValueError, match="continue"):
        attn(torch.randn(1, 1, 16), torch.tensor([5]), cache=cache)
    bidir = MultiheadDilatedAttention(16, 2, [(8, 1)], causal=False)
    with pytest.raises(ValueError, match="causal"):
        bidir(torch.randn(1, 3, 16), cache=LayerKVCache())


def test_a_refused_cached_call_leaves_the_convolution_tail_as_it_was():
    torch.manual_seed(9)
    attn = MultiheadDilatedAttention(16, 2, [(4, 1), (8, 2)], kv_conv_size=3).double()
    with torch.no_grad():
        attn.kv_conv.weight.normal_()
    x = torch.randn(1, 9, 16, dtype=F64)
    cache = LayerKVCache()
    first = attn(x[:, :5], cache=cache)
    with pytest.raises(ValueError, match="continue"):
        attn(x[:, 5:7], torch.tensor([6, 7]), cache=cache)
    rest = attn(x[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat((first, rest), dim=1), attn(x), rtol=1e-10, atol=1e-10)


def test_attention_argument_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadDilatedAttention(16, 4, [(8, 1)], num_kv_heads=3)
    with pytest.raises(ValueError, match="divisible"):
        MultiheadDilatedAttention(18, 4, [(8, 1)])
    attn = MultiheadDilatedAttention(16, 2, [(8, 1)])
    with pytest.raises(ValueError, match="position_ids"):
        attn(torch.randn(2, 5, 16), torch.arange(4))
    with pytest.raises(TypeError, match="integer"):
        attn(torch.randn(2, 5, 16), torch.arange(5.0))


def test_feed_forward_kinds_and_sub_ln():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 8, dtype=F64)
    mlp = MLP(8, 16, activation="gelu_tanh").double()
    ref = mlp.down_proj(F.gelu(mlp.up_proj(x), approximate="tanh"))
    torch.testing.assert_close(mlp(x), ref, rtol=0, atol=1e-14)
    glu = GatedMLP(8, 12, activation="silu").double()
    ref = glu.down_proj(F.silu(glu.gate_proj(x)) * glu.up_proj(x))
    torch.testing.assert_close(glu(x), ref, rtol=0, atol=1e-14)
    sub = MLP(8, 16, sub_ln=True).double()
    ref = sub.down_proj(sub.sub_norm(F.gelu(sub.up_proj(x))))
    torch.testing.assert_close(sub(x), ref, rtol=0, atol=1e-14)
    assert isinstance(sub.sub_norm, torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="activation"):
        MLP(8, 16, activation="tanh")


def test_sub_ln_norm_sits_before_attention_output_projection():
    torch.manual_seed(4)
    attn = MultiheadDilatedAttention(16, 2, [(8, 1)], sub_ln=True, norm="rmsnorm").double()
    plain = MultiheadDilatedAttention(16, 2, [(8, 1)]).double()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "sub_norm" not in k})
    x = torch.randn(1, 8, 16, dtype=F64)
    # recover the pre-projection attention output of the plain layer and normalise it
    inner = torch.linalg.solve(plain.out_proj.weight, (plain(x) - plain.out_proj.bias).mT).mT
    torch.testing.assert_close(attn(x), attn.out_proj(attn.sub_norm(inner)), rtol=1e-9, atol=1e-9)


def _block(checkpointing: bool) -> TransformerBlock:
    torch.manual_seed(5)
    attn = MultiheadDilatedAttention(
        16, 2, [(4, 1), (8, 2)], causal=True, positional=RotaryEmbedding(8), sub_ln=True
    )
    return TransformerBlock(
        attn,
        GatedMLP(16, 24, sub_ln=True),
        RMSNorm(16),
        RMSNorm(16),
        gradient_checkpointing=checkpointing,
    ).double()


def test_block_gradient_checkpointing_gives_equal_gradients():
    x = torch.randn(2, 19, 16, dtype=F64)
    upstream = torch.randn(2, 19, 16, dtype=F64)
    grads = []
    for checkpointing in (False, True):
        block = _block(checkpointing)
        xi = x.clone().requires_grad_(True)
        (block(xi) * upstream).sum().backward()
        grads.append([xi.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "pattern",
    [DilatedPattern((3, 5, 12), (1, 2, 3)), DilatedPattern((4, 10), (2, 3))],
    ids=["not-nested", "no-rate-1"],
)
def test_cached_chunks_equal_full_run_for_irregular_patterns(pattern):
    torch.manual_seed(6)
    attn = MultiheadDilatedAttention(
        24, 6, pattern, causal=True, positional=RotaryEmbedding(4)
    ).double()
    x = torch.randn(2, 41, 24, dtype=F64)
    full = attn(x)
    cache = LayerKVCache()
    chunks = [(0, 7), (7, 8), (8, 20), *[(i, i + 1) for i in range(20, 41)]]
    out = torch.cat([attn(x[:, a:b], cache=cache) for a, b in chunks], dim=1)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)
