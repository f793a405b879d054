"""Exactness of single-device dilated attention against the independent dense reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from longnet.attention import DilatedPattern, dilated_attention, padded_length
from longnet.attention.kernels import (
    BlockBackward,
    cpu_flash_backward,
    cpu_flash_forward,
    lse_merge_,
    math_backward,
    math_forward,
)
from tests.reference import branch_counts, dense_dilated_attention

TOL = 1e-10

# (name, seq_len, heads, branches): each bullet of the spec is covered by at least one case.
CASES = [
    ("paper_rates_not_dividing", 97, 12, [(4, 1), (8, 2), (16, 4), (32, 6), (64, 12)]),
    ("last_segment_shorter", 45, 4, [(8, 1), (16, 2)]),
    ("segment_longer_than_seq", 20, 4, [(8, 1), (64, 4)]),
    ("fewer_heads_than_rate", 40, 3, [(8, 1), (40, 8)]),
    ("no_unit_rate_uncovered_rows", 30, 3, [(6, 2), (15, 5)]),
    ("single_dilated_branch", 33, 2, [(12, 3)]),
    ("rate_equals_segment", 24, 5, [(4, 4), (12, 1)]),
    ("dense", 31, 2, [(64, 1)]),
    ("later_unit_rate_with_tail", 45, 4, [(4, 2), (8, 1), (16, 1)]),
]


def _inputs(batch, seq_len, heads, dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=dtype).requires_grad_()
        for _ in range(3)
    ]


def _grads(outputs, upstream, inputs):
    loss = sum((o * g).sum() for o, g in zip(outputs, upstream))
    return torch.autograd.grad(loss, inputs, retain_graph=True)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name,seq_len,heads,branches", CASES, ids=[c[0] for c in CASES])
def test_matches_dense_reference_float64(name, seq_len, heads, branches, causal):
    q, k, v = _inputs(2, seq_len, heads, 8)
    out, lse = _assert_matches_reference(q, k, v, branches, causal, grad_seed=1)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert lse.shape == (2, heads, seq_len)


LAYOUTS = {  # memory layouts of (batch, seq, heads, dim) inputs
    "channel_major": "b (h d) n -> b n h d",  # a convolution's output: seq has stride 1
    "head_major": "b h n d -> b n h d",
    "dim_outermost": "d b n h -> b n h d",  # head_dim has the largest stride
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_inputs_in_any_memory_layout_match_dense_reference(layout, causal):
    """Views whose last dimension is not contiguous in memory give the exact function (the
    fused kernels read rows as consecutive memory, so they must get copies)."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"channel_major": (2, 4 * 8, 45), "head_major": (2, 4, 45, 8),
              "dim_outermost": (8, 2, 45, 4)}
    q, k, v = (
        rearrange(torch.randn(shapes[layout], generator=gen, dtype=torch.float64),
                  LAYOUTS[layout], h=4).requires_grad_()
        for _ in range(3)
    )
    assert q.shape == (2, 45, 4, 8) and (layout == "head_major") == (q.stride(-1) == 1)
    _assert_matches_reference(q, k, v, [(8, 1), (16, 2), (64, 1)], causal, grad_seed=2)


def _assert_matches_reference(
    q, k, v, branches, causal: bool, grad_seed: int, block_elements: int | None = None
):
    """out and lse of ``dilated_attention`` equal the dense reference to ``TOL`` (same ``-inf``
    rows), and so do dq, dk, dv (finite) for a random upstream gradient into out, and into out
    and lse together (the fused and the math-kernel backward). Returns ``(out, lse)``."""
    out, lse = dilated_attention(
        q, k, v, branches, causal=causal, return_lse=True, block_elements=block_elements
    )
    ref_out, ref_lse = dense_dilated_attention(q, k, v, branches, causal)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=TOL, rtol=0)

    gen = torch.Generator().manual_seed(grad_seed)
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0)
    lse_term = lse.masked_fill(~finite, 0)
    ref_lse_term = ref_lse.masked_fill(~finite, 0)
    for with_lse in (False, True):
        grads = _grads([out, lse_term][: 1 + with_lse], [d_out, d_lse], (q, k, v))
        ref_grads = _grads([ref_out, ref_lse_term][: 1 + with_lse], [d_out, d_lse], (q, k, v))
        for grad, ref_grad in zip(grads, ref_grads):
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)
    return out, lse


def test_uncovered_rows_are_zero_with_neg_inf_lse():
    q, k, v = _inputs(1, 12, 2, 4)
    out, lse = dilated_attention(q, k, v, [(6, 3)], return_lse=True)
    counts = branch_counts(12, 2, [(6, 3)], causal=False)
    uncovered = counts.sum(-1) == 0  # (heads, seq)
    assert uncovered.any()
    assert torch.isneginf(lse[0][uncovered]).all()
    assert (out[0].transpose(0, 1)[uncovered] == 0).all()
    d_q, d_k, d_v = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (d_q, d_k, d_v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dense_pattern_equals_sdpa(causal, dtype):
    q, k, v = _inputs(2, 50, 3, 16, dtype=dtype)
    out = dilated_attention(q, k, v, DilatedPattern.dense(64), causal=causal)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    ).transpose(1, 2)
    tol = TOL if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, sdpa, atol=tol, rtol=0)
    d_out = torch.randn_like(out)
    for grad, ref_grad in zip(
        _grads([out], [d_out], (q, k, v)), _grads([sdpa], [d_out], (q, k, v))
    ):
        torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=0)


def test_custom_scale_matches_reference():
    q, k, v = _inputs(1, 40, 4, 8)
    branches = [(8, 1), (32, 4)]
    out = dilated_attention(q, k, v, branches, causal=True, scale=0.37)
    ref_out, _ = dense_dilated_attention(q, k, v, branches, causal=True, scale=0.37)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)


@pytest.mark.parametrize("position", [0, 17, 40])
def test_causality_future_tokens_change_nothing_before(position):
    branches = [(8, 1), (16, 2), (48, 6)]
    q, k, v = _inputs(1, 48, 6, 8)
    d_out = torch.randn(q.shape, dtype=torch.float64)
    d_out[:, position + 1 :] = 0  # the loss reads outputs at or before `position` only

    def run(tensors):
        out = dilated_attention(*tensors, branches, causal=True)
        return out, torch.autograd.grad((out * d_out).sum(), tensors)

    out, grads = run((q, k, v))
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[:, position + 1 :] = torch.randn_like(t[:, position + 1 :]) * 10
    out2, grads2 = run(tuple(t.requires_grad_() for t in changed))

    keep = slice(0, position + 1)
    torch.testing.assert_close(out2[:, keep], out[:, keep], atol=1e-12, rtol=0)
    for grad, grad2 in zip(grads, grads2):
        torch.testing.assert_close(grad2[:, keep], grad[:, keep], atol=1e-12, rtol=0)
    if position + 1 < 48:  # sanity: the perturbation does change later outputs
        assert not torch.allclose(out2[:, position + 1 :], out[:, position + 1 :])


def test_bfloat16_error_no_worse_than_sdpa():
    q, k, v = _inputs(1, 512, 8, 64, seed=3)
    branches = [(128, 1), (256, 2), (512, 4)]
    truth, _ = dense_dilated_attention(q, k, v, branches, causal=True)
    ours = dilated_attention(*(t.bfloat16() for t in (q, k, v)), branches, causal=True)
    assert ours.dtype == torch.bfloat16

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    dense_truth = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    dense_bf16 = F.scaled_dot_product_attention(
        qt.bfloat16(), kt.bfloat16(), vt.bfloat16(), is_causal=True
    )

    def relative_rms(approx, exact):  # dilated outputs average fewer keys, so they are larger:
        return ((approx.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()

    ours_error = relative_rms(ours, truth)
    sdpa_error = relative_rms(dense_bf16, dense_truth)
    assert ours_error <= 1.5 * sdpa_error, (ours_error, sdpa_error)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 5e-3)])
def test_reduced_precision_close_to_reference(dtype, tol):
    q, k, v = _inputs(2, 70, 4, 16)
    branches = [(16, 1), (32, 2), (70, 6)]
    truth, truth_lse = dense_dilated_attention(q, k, v, branches, causal=True)
    out, lse = dilated_attention(
        *(t.to(dtype) for t in (q, k, v)), branches, causal=True, return_lse=True
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), truth, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), truth_lse, atol=tol, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_math_kernel_matches_cpu_flash_kernel(causal):
    gen = torch.Generator().manual_seed(5)
    q, k, v, d_out = (
        torch.randn(3, 2, 19, 8, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    out, lse = cpu_flash_forward(q, k, v, causal, 0.3)
    math_out, math_lse = math_forward(q, k, v, causal, 0.3)
    torch.testing.assert_close(math_out, out, atol=TOL, rtol=0)
    torch.testing.assert_close(math_lse, lse, atol=TOL, rtol=0)
    # A backward run with a foreign (global) lse and out, as the mixture backward does.
    global_out, global_lse = torch.randn_like(out), lse + torch.rand_like(lse)
    block = BlockBackward(d_out, q, k, v, global_out, global_lse)
    flash = cpu_flash_backward(block, causal, 0.3)
    math = math_backward(block, causal, 0.3)
    for a, b in zip(math, flash):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_lse_merge_handles_empty_sides():
    inf = float("-inf")
    lse_a = torch.tensor([inf, inf, 0.5], dtype=torch.float64)
    lse_b = torch.tensor([inf, 1.0, inf], dtype=torch.float64)
    out_a = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)  # 0 if empty
    out_b = 2 * torch.ones(3, 2, dtype=torch.float64)
    lse_merge_(out_a, lse_a, out_b, lse_b)
    assert not out_a.isnan().any()
    assert torch.equal(lse_a, torch.tensor([inf, 1.0, 0.5], dtype=torch.float64))
    expected = torch.tensor([[0.0, 0.0], [2.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    assert torch.equal(out_a, expected)


def test_lse_merge_keeps_a_nan_side_nan():
    nan, inf = float("nan"), float("-inf")
    for lse_a, lse_b in ((0.5, nan), (nan, 0.5), (nan, inf), (inf, nan)):
        out_a, out_b = torch.ones(1, 2), 2 * torch.ones(1, 2)
        lse = torch.tensor([lse_a])
        lse_merge_(out_a, lse, out_b, torch.tensor([lse_b]))
        assert out_a.isnan().all() or lse_b == inf, (lse_a, lse_b)
        assert lse.isnan().all(), (lse_a, lse_b)


def _qkv(*shape, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda q, k, v: dilated_attention(q[0], k[0], v[0], [(8, 1)]), ValueError, "must be 4-D"),
        (lambda q, k, v: dilated_attention(q, k[:, :4], v, [(8, 1)]), ValueError,
         "kv_heads dividing heads"),
        (lambda q, k, v: dilated_attention(q, k[:, :, :1].expand(-1, -1, 3, -1),
                                           v[:, :, :1].expand(-1, -1, 3, -1), [(8, 1)]),
         ValueError, "kv_heads dividing heads"),
        (lambda q, k, v: dilated_attention(q, k.double(), v, [(8, 1)]), TypeError, "dtypes differ"),
        (
            lambda q, k, v: dilated_attention(q.long(), k.long(), v.long(), [(8, 1)]),
            TypeError,
            "floating",
        ),
        (lambda q, k, v: dilated_attention(q, k, v, [(8, 0)]), ValueError, "positive integers"),
        (lambda q, k, v: dilated_attention(q, k, v, [(8, 1), (4, 1)]), ValueError, "increasing"),
        (
            lambda q, k, v: dilated_attention(q, k, v, [(4, 8)]),
            ValueError,
            "larger than its segment",
        ),
        (lambda q, k, v: dilated_attention(q, k, v, [(4, 1, 2)]), ValueError, "pair"),
        (lambda q, k, v: dilated_attention(q, k, v, 5), TypeError, "DilatedPattern"),
        (lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], scale=-1.0), ValueError, "scale"),
        (
            lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], scale=float("inf")),
            ValueError,
            "finite positive number.*inf",
        ),
        (lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], scale=0.0), ValueError, "scale"),
        (lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], scale=True), ValueError, "True"),
        (
            lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], causal="no"),
            TypeError,
            "causal must be True or False, got 'no'",
        ),
        (
            lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], return_lse=1),
            TypeError,
            "return_lse must be True or False",
        ),
        (
            lambda q, k, v: dilated_attention(q, k, v, [(8, 1)], check_finite="yes"),
            TypeError,
            "check_finite",
        ),
        (lambda q, k, v: dilated_attention(q, k, v, []), ValueError, "empty"),
        (
            lambda q, k, v: dilated_attention(q[:, :0], k[:, :0], v[:, :0], [(8, 1)]),
            ValueError,
            "empty",
        ),
        (lambda q, k, v: DilatedPattern((8, 16), (1,)), ValueError, "one dilation rate"),
    ],
)
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call(*_qkv(2, 8, 2, 4))


@pytest.mark.parametrize("seq_len", [16, 4096])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_check_finite_names_the_tensor_with_a_nan_or_inf(seq_len, dtype, bad, where):
    tensors = dict(zip("qkv", _qkv(1, seq_len, 2, 8, dtype=dtype)))
    tensors[where][0, seq_len // 3, 1, 5] = bad
    branches = [(8, 1), (16, 2)]
    with pytest.raises(ValueError, match=f"{where} holds 1 NaN or infinite value"):
        dilated_attention(*tensors.values(), branches, causal=True, check_finite=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_passes_finite_inputs_unchanged(dtype):
    q, k, v = _qkv(1, 16, 2, 8, dtype=dtype)
    checked = dilated_attention(q, k, v, [(8, 1), (16, 2)], causal=True, check_finite=True)
    assert torch.equal(checked, dilated_attention(q, k, v, [(8, 1), (16, 2)], causal=True))


@pytest.mark.parametrize(
    "seq_len,branches,world,expected",
    [
        (100, [(8, 1), (32, 2)], 4, 128),  # shard 25 -> 32 (8 divides it, 32 equals it)
        (96, [(8, 1), (32, 2)], 4, 128),  # shard 24: 32 is no multiple of 24
        (30, [(4, 1), (1000, 4)], 3, 36),  # w beyond the sequence is capped at the length
        (7, [(16, 1)], 1, 7),
    ],
)
def test_padded_length(seq_len, branches, world, expected):
    assert padded_length(seq_len, branches, world) == expected


def _random_case(seed: int) -> dict:
    """A seeded random call: one to four branches (segments 2..69, rates 1..9, half of them 1),
    any length 1..90, batch 1..3, heads 1..7, a chunk budget from one element up."""
    rng = random.Random(seed)
    segments = sorted(rng.sample(range(2, 70), rng.randint(1, 4)))
    branches = [(w, rng.choice((1, rng.randint(1, min(w, 9))))) for w in segments]
    return dict(
        branches=branches,
        shape=(rng.randint(1, 3), rng.randint(1, 90), rng.randint(1, 7), rng.choice((4, 8))),
        causal=rng.random() < 0.5,
        block_elements=rng.choice((1, 17, 500, 2**18)),
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_calls_match_dense_reference(seed):
    case = _random_case(seed)
    q, k, v = _inputs(*case["shape"], seed=seed)
    _assert_matches_reference(
        q, k, v, case["branches"], case["causal"], grad_seed=seed,
        block_elements=case["block_elements"],
    )


@pytest.mark.parametrize("block_elements", [1, 40, 200])
def test_chunked_execution_is_exact(block_elements):
    """Tiny block budgets force per-head and per-segment pieces (as on long sequences)."""
    branches = [(4, 1), (8, 2), (30, 3)]
    q, k, v = _inputs(2, 30, 4, 4)
    out, lse = dilated_attention(
        q, k, v, branches, causal=True, return_lse=True, block_elements=block_elements
    )
    ref_out, ref_lse = dense_dilated_attention(q, k, v, branches, causal=True)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=TOL, rtol=0)
    d_out = torch.randn(out.shape, dtype=torch.float64)
    for grad, ref_grad in zip(
        _grads([out], [d_out], (q, k, v)), _grads([ref_out], [d_out], (q, k, v))
    ):
        torch.testing.assert_close(grad, ref_grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("kernel", ["auto", "math"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nan_reaches_exactly_the_rows_that_see_it(kernel, where):
    """As in dense attention: a NaN query gives a NaN row, a NaN key NaN in the rows that
    attend to it (per the reference's multiplicity), never a silent zero, and nowhere else."""
    branches, heads, seq_len, position, head = [(8, 1), (16, 2)], 2, 16, 3, 0
    q, k, v = _qkv(1, seq_len, heads, 8)
    {"q": q, "k": k}[where].detach()[0, position, head, 0] = float("nan")
    out, lse = dilated_attention(
        q, k, v, branches, causal=True, return_lse=True, kernel=kernel
    )
    if where == "q":
        expected = torch.arange(seq_len) == position
    else:
        expected = branch_counts(seq_len, heads, branches, causal=True)[head, :, position] > 0
    assert torch.equal(out[0, :, head].isnan().any(-1), expected)
    assert torch.equal(lse[0, head].isnan(), expected)
    assert not out[0, :, 1 - head].isnan().any()


@pytest.fixture
def group_of_one():
    """A gloo process group of this process alone (a group of size 1 runs as one device)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sequence_parallel": "G"}, TypeError, "sequence_parallel must be a "
     "longnet.distributed.SequenceParallel or None, got ProcessGroup"),
    ({"segment_lengths": (8,)}, TypeError,
     r"dilated_attention\(\) got an unexpected keyword argument 'segment_lengths'"),
])
def test_sequence_parallel_keywords_that_cannot_apply_raise(group_of_one, kwargs, error, match):
    values = {"G": group_of_one}
    kwargs = {name: values.get(value, value) if isinstance(value, str) else value
              for name, value in kwargs.items()}
    q, k, v = _qkv(1, 8, 2, 4)
    with pytest.raises(error, match=match):
        dilated_attention(q, k, v, [(8, 1)], **kwargs)
