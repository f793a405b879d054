"""``lab.scripts.divided_positions``: each branch rotated by positions divided by its rate,
against a brute-force softmax in float64; rate-1 branches alone equal the library's layer."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange, repeat

from lab.scripts.divided_positions import divided_forward
from longnet.attention import DilatedPattern, Retrieval
from longnet.nn.attention import MultiheadDilatedAttention
from longnet.nn.positional import RotaryEmbedding


def _layer(pattern, retrieval=None, positions="own") -> MultiheadDilatedAttention:
    torch.manual_seed(0)
    return MultiheadDilatedAttention(32, 4, pattern, num_kv_heads=2, bias=False,
                                     positional=RotaryEmbedding(8), retrieval=retrieval,
                                     retrieval_positions=positions).double()


def test_rate_one_branches_equal_the_library_layer():
    layer = _layer([(8, 1), (24, 1)], Retrieval(sinks=2, block=3, top_k=2), "before_segment")
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    torch.testing.assert_close(divided_forward(layer, x), layer(x), rtol=0, atol=1e-12)


def test_sparse_branches_match_a_brute_force_softmax_with_divided_positions():
    pattern = [(6, 1), (12, 2), (24, 4)]
    layer = _layer(pattern)
    n, heads = 22, 4
    x = torch.randn(1, n, 32, dtype=torch.float64)
    q = rearrange(layer.q_proj(x), "b n (h d) -> b n h d", h=heads)
    k = repeat(layer.k_proj(x), "b n (h d) -> b n (h g) d", h=2, g=2)
    v = repeat(layer.v_proj(x), "b n (h d) -> b n (h g) d", h=2, g=2)
    positions = torch.arange(n)
    numerator = torch.zeros(n, heads, 8, dtype=torch.float64)
    denominator = torch.zeros(n, heads, 1, dtype=torch.float64)
    for w, r in pattern:
        counts = DilatedPattern([(w, r)]).key_multiplicity(positions, positions, heads, True)
        given = counts.nonzero()
        assert ((given[:, 1] - given[:, 2]) % r == 0).all()  # aligned: distances divide by r
        q_r, k_r = layer.positional(q, k, positions // r)
        scores = torch.einsum("phd,thd->hpt", q_r[0], k_r[0]) * layer.scale
        weights = counts * scores.exp()
        numerator += torch.einsum("hpt,thd->phd", weights, v[0])
        denominator += rearrange(weights.sum(-1), "h p -> p h 1")
    expected = layer.out_proj(rearrange(numerator / denominator, "p h d -> 1 p (h d)"))
    torch.testing.assert_close(divided_forward(layer, x), expected, rtol=0, atol=1e-12)


def test_what_the_experiment_does_not_support_is_named():
    layer = _layer([(8, 1)])
    with pytest.raises(NotImplementedError, match="document_ids"):
        divided_forward(layer, torch.randn(1, 8, 32, dtype=torch.float64),
                        document_ids=torch.zeros(1, 8, dtype=torch.long))
