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
    """``x + attn(attn_norm(x))`` then ``h + ffn(ffn_norm(h))``.

    Pre-LN; sub-LN (MAGNETO) adds norms *inside* ``attn`` and ``ffn`` (built into those
    modules with ``sub_ln=True``).  Each sub-layer applies its own output dropout.

    With ``gradient_checkpointing`` the block's activations are recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant) whenever gradients are enabled and no KV cache
    is used.  Under sequence parallelism (the attention's ``sequence_parallel``, set by
    :func:`longnet.distributed.parallelize`) the recomputation communicates again: every rank
    of the group must run the same backward.

    ``document_ids`` ``(batch, seq)`` (packed documents; or a ``PackedDocuments``, resolved once
    by ``LongNetModel``) go to the attention.

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
        cache: LayerKVCache | None = None,
        document_ids: Tensor | PackedDocuments | None = None,
    ) -> Tensor:
        """``x`` ``(batch, seq, embed_dim)`` -> ``(batch, seq, embed_dim)``; ``position_ids``,
        ``cache`` and ``document_ids`` as :meth:`MultiheadDilatedAttention.forward` takes
        them."""
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
