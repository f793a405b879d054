"""Normalisation layers: LayerNorm and RMSNorm, chosen by name."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longnet.validation import check_choice, check_positive_float, check_positive_int

NORM_KINDS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """RMS norm over ``(..., dim)``, computed in at least float32 (cast back before weight)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = check_positive_float("eps", eps)
        self.weight = nn.Parameter(torch.ones(check_positive_int("dim", dim)))

    def forward(self, x: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute_dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def check_norm(kind: str, eps: float) -> None:
    """Raise ``ValueError`` unless ``kind`` is in :data:`NORM_KINDS` and ``eps`` positive."""
    check_choice("norm", kind, NORM_KINDS)
    check_positive_float("norm_eps", eps)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """A ``"layernorm"`` or ``"rmsnorm"`` layer over a last dimension of width ``dim``."""
    check_norm(kind, eps)
    dim = check_positive_int("dim", dim)
    return nn.LayerNorm(dim, eps=eps) if kind == "layernorm" else RMSNorm(dim, eps=eps)
