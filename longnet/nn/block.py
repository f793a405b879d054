"""A pre-LN transformer block (optionally MAGNETO sub-LN) with optional gradient checkpointing."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longnet.nn.attention import LayerKVCache, MultiheadDilatedAttention
from longnet.validation import check_bool


class TransformerBlock(nn.Module):
    """``x + attn(attn_norm(x))`` then ``h + ffn(ffn_norm(h))``.

    Pre-LN; sub-LN (MAGNETO) adds norms *inside* ``attn`` and ``ffn`` (built into those
    modules with ``sub_ln=True``).  Each sub-layer applies its own output dropout.

    With ``gradient_checkpointing`` the block's activations are recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant) whenever gradients are enabled and no KV cache
    is used.  The sequence-parallel ``group`` is passed to the attention, so the recomputation
    communicates again: every rank of the group must run the same backward.

    ``document_ids`` ``(batch, seq)`` (packed documents) go to the attention.

    Shapes: ``x`` ``(batch, seq, embed_dim)`` -> ``(batch, seq, embed_dim)``.
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
        group: torch.distributed.ProcessGroup | None = None,
        cache: LayerKVCache | None = None,
        document_ids: Tensor | None = None,
        layout: str = "contiguous",
    ) -> Tensor:
        if self.gradient_checkpointing and cache is None and torch.is_grad_enabled():
            return checkpoint(self._forward, x, position_ids, group, None, document_ids, layout,
                              use_reentrant=False)
        return self._forward(x, position_ids, group, cache, document_ids, layout)

    def _forward(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        group: torch.distributed.ProcessGroup | None,
        cache: LayerKVCache | None,
        document_ids: Tensor | None,
        layout: str,
    ) -> Tensor:
        h = x + self.attn(self.attn_norm(x), position_ids, group, cache, document_ids, layout)
        return h + self.ffn(self.ffn_norm(h))
