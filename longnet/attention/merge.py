"""Numerically safe log-sum-exp merge of partial attention results."""

from __future__ import annotations

import torch
from torch import Tensor


def lse_merge_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold attention over key set B into attention over key set A, in place in ``out_a, lse_a``.

    Args:
        out_a, out_b: ``(..., length, dim)`` normalised outputs of each part.
        lse_a, lse_b: ``(..., length)`` log-sum-exp of each part's scores (``-inf``: no keys;
            ``out_a`` must then be 0 there, as fresh accumulators are).
    The union's output is ``out_a + w (out_b - out_a)`` with ``w = exp(lse_b - lse_union)
    = sigmoid(lse_b - lse_a)`` (the two weights sum to 1): one pass over the outputs. Rows with
    no keys on either side (``-inf - -inf``) get ``w = 0``: ``out = 0``, ``lse = -inf``, no NaN.
    """
    weight = torch.sigmoid(torch.nan_to_num(lse_b - lse_a, nan=float("-inf")))
    out_a.lerp_(out_b.to(out_a.dtype), weight[..., None].to(out_a.dtype))
    torch.logaddexp(lse_a, lse_b, out=lse_a)
