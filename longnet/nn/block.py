"""A pre-LN transformer block (optionally MAGNETO sub-LN) with optional gradient checkpointing."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longnet.attention.documents import PackedDocuments
from longnet.nn.attention import MultiheadDilatedAttention
from longnet.nn.kv_cache import LayerKVCache
from longnet.validation import check_bool


class TransformerBlock(nn.Module):
    """Pre-LN block: ``h = x + attn(attn_norm(x))``, then ``h + ffn(ffn_norm(h))``.

    ``gradient_checkpointing`` recomputes it in backward (not with a KV cache).
    """

    def __init__(
        self,
        attn: MultiheadDilatedAttention,
        ffn: nn.Module,
        attn_norm: nn.Module,
        ffn_norm: nn.Module,
        *,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.ffn_norm = ffn_norm
        self.ffn = ffn
        self.gradient_checkpointing = check_bool("gradient_checkpointing", gradient_checkpointing)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        cache: LayerKVCache | None = None,
        document_ids: Tensor | PackedDocuments | None = None,
    ) -> Tensor:
        """Arguments and shapes as :meth:`MultiheadDilatedAttention.forward`."""
        if self.gradient_checkpointing and cache is None and torch.is_grad_enabled():
            return checkpoint(self._forward, x, position_ids, None, document_ids,
                              use_reentrant=False)
        return self._forward(x, position_ids, cache, document_ids)

    def _forward(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        cache: LayerKVCache | None,
        document_ids: Tensor | PackedDocuments | None,
    ) -> Tensor:
        h = x + self.attn(self.attn_norm(x), position_ids, cache, document_ids)
        return h + self.ffn(self.ffn_norm(h))
