"""Numerically safe log-sum-exp merge of two partial attention results."""

from __future__ import annotations

import torch
from torch import Tensor


def lse_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    Args:
        out_a, out_b: ``(..., length, dim)`` normalised outputs of each part.
        lse_a, lse_b: ``(..., length)`` log-sum-exp of each part's scores (``-inf``: no keys).
    Returns:
        ``(out, lse)`` in the dtype of ``lse_a``; rows with no keys on either side give
        ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite)[..., None]
    weight_b = torch.exp(lse_b - finite)[..., None]
    out = out_a.to(lse.dtype) * weight_a + out_b.to(lse.dtype) * weight_b
    return out, lse
