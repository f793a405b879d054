"""Position-wise feed-forward networks: a plain MLP (GELU) and a gated one (SwiGLU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from longnet.nn.norm import build_norm, check_norm
from longnet.validation import check_bool, check_choice, check_dropout, check_positive_int

FFN_KINDS = ("mlp", "glu")

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function called ``name`` (one of :data:`ACTIVATIONS`)."""
    return ACTIVATIONS[check_choice("activation", name, ACTIVATIONS)]


class MLP(nn.Module):
    """``dropout(down_proj(sub_norm?(act(up_proj(x)))))`` over ``(..., embed_dim)``."""

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        sub_ln: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        embed_dim = check_positive_int("embed_dim", embed_dim)
        hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        bias, sub_ln = check_bool("bias", bias), check_bool("sub_ln", sub_ln)
        check_norm(norm, norm_eps)
        self.activation_name = activation
        self.activation = get_activation(activation)
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.sub_norm = build_norm(norm, hidden_dim, norm_eps) if sub_ln else None
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(check_dropout("dropout", dropout))

    def hidden(self, x: Tensor) -> Tensor:
        """The activations before the second linear layer ``(..., hidden_dim)``."""
        return self.activation(self.up_proj(x))

    def forward(self, x: Tensor) -> Tensor:
        h = self.hidden(x)
        if self.sub_norm is not None:
            h = self.sub_norm(h)
        return self.dropout(self.down_proj(h))

    def extra_repr(self) -> str:
        return f"activation={self.activation_name}"


class GatedMLP(MLP):
    """Gated linear unit ``down_proj(act(gate_proj(x)) * up_proj(x))``; Llama's defaults."""

    def __init__(self, embed_dim: int, hidden_dim: int, *, activation: str = "silu",
                 bias: bool = False, **kwargs: Any) -> None:
        super().__init__(embed_dim, hidden_dim, activation=activation, bias=bias, **kwargs)
        self.gate_proj = nn.Linear(self.up_proj.in_features, self.up_proj.out_features, bias=bias)

    def hidden(self, x: Tensor) -> Tensor:
        return self.activation(self.gate_proj(x)) * self.up_proj(x)


def build_feed_forward(kind: str, embed_dim: int, hidden_dim: int, **kwargs) -> MLP:
    """``"mlp"`` -> :class:`MLP`, ``"glu"`` -> :class:`GatedMLP` (keyword args as theirs)."""
    check_choice("ffn_kind", kind, FFN_KINDS)
    return (MLP if kind == "mlp" else GatedMLP)(embed_dim, hidden_dim, **kwargs)
