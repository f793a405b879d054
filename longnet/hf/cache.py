"""``LongNetCache``: LongNet's exact dilated-pattern KV cache, in the shape ``generate`` wants
(``get_seq_length``, ``reorder_cache``): one :class:`longnet.nn.KVCache` per group of rows
with the same left padding (:mod:`longnet.hf.padding`), holding their real tokens only, so
each group decodes exactly as an unpadded batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longnet.hf.padding import RowGroup, row_groups
from longnet.nn import KVCache


class LongNetCache:
    """KV caches of the row groups of one batch; the first call fixes the rows' left padding,
    later calls bring the same (the mask extended by ones) or none."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.seen = 0
        self.padding: Tensor | None = None
        self.groups: list[tuple[RowGroup, KVCache]] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns (tokens and padding) the model has read through this cache."""
        return self.seen

    def bind(self, padding: Tensor, batch: int) -> list[tuple[RowGroup, KVCache]]:
        """The row groups and caches for ``batch`` rows of left padding ``padding``
        ``(batch,)``; the first call creates them.

        Raises:
            ValueError: the batch size or the padding differs from the first call's.
        """
        if self.padding is None:
            self.padding = padding
            self.groups = [(group, KVCache(self.num_layers)) for group in row_groups(padding)]
        if len(self.padding) != batch:
            raise ValueError(
                f"this cache holds {len(self.padding)} rows, the input has {batch}; use one "
                "cache per batch (a fresh one for a new batch)."
            )
        if not torch.equal(padding.to(self.padding.device), self.padding):
            raise ValueError(
                "the attention mask's left padding differs from the cached one: extend the "
                "mask of the first call with ones for the new tokens."
            )
        return self.groups

    def advance(self, columns: int) -> None:
        """Record that the model read ``columns`` more columns."""
        self.seen += columns

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Row ``i`` continues old row ``beam_idx[i]`` ``(batch,)`` (beam search).

        Raises:
            ValueError: a row would continue a row of another left padding.
        """
        if self.padding is None:
            return
        beam_idx = beam_idx.to(self.padding.device)
        if not torch.equal(self.padding[beam_idx], self.padding):
            raise ValueError("reorder_cache: a row would continue a row of another padding.")
        local = torch.empty_like(self.padding)
        for group, _ in self.groups:
            local[group.rows] = torch.arange(len(group.rows), device=local.device)
        for group, cache in self.groups:
            cache.select_rows(local[beam_idx[group.rows]])
