"""Numerically safe log-sum-exp merge of partial attention results."""

from __future__ import annotations

import torch
from torch import Tensor


def lse_merge_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold attention over key set B into attention over key set A, in place in ``out_a, lse_a``.

    Args:
        out_a, out_b: ``(..., length, dim)`` normalised outputs of each part.
        lse_a, lse_b: ``(..., length)`` log-sum-exp of each part's scores (``-inf``: no keys).
    Afterwards ``out_a, lse_a`` hold the attention over the union; rows with no keys on either
    side give ``out = 0`` and ``lse = -inf`` (never NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out_a.mul_(torch.exp(lse_a - finite)[..., None])
    out_a.addcmul_(out_b, torch.exp(lse_b - finite)[..., None])
    lse_a.copy_(lse)
