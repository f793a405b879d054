"""``LongNetCache``: LongNet's exact dilated-pattern KV cache, in the shape ``generate`` wants.

``transformers``' ``generate`` keeps the model's cache between calls and asks two things of
it: ``get_seq_length()`` (the columns seen so far, padding included) and, in beam search,
``reorder_cache(beam_idx)``. Everything else stays LongNet's own: one
:class:`longnet.nn.KVCache` (per layer, the keys and values that some future query can still
attend to under the dilated pattern, about one largest segment) per group of rows with the
same left padding (:mod:`longnet.hf.padding`; one group when nothing is padded). Each group
holds its rows' real tokens only, at positions 0, 1, ... from its first token, so every group
decodes exactly as an unpadded batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longnet.hf.padding import RowGroup, row_groups
from longnet.nn import KVCache


class LongNetCache:
    """KV caches of the row groups of one batch (module docstring).

    The first model call fixes the batch's rows and their left padding; later calls must
    bring the same padding (``transformers`` extends the mask by ones) or none.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.seen = 0
        self.padding: Tensor | None = None
        self.groups: list[tuple[RowGroup, KVCache]] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns (tokens and padding) the model has read through this cache."""
        return self.seen

    def bind(self, padding: Tensor, batch: int) -> list[tuple[RowGroup, KVCache]]:
        """The row groups and their caches for a call on ``batch`` rows whose left padding is
        ``padding`` ``(batch,)``; the first call creates them.

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
        """Row ``i`` continues old row ``beam_idx[i]`` ``(batch,)``; each group's caches are
        reordered with ``KVCache.select_rows`` (beam search).

        Raises:
            ValueError: a row would continue a row of another left padding (beam search
                never does that: hypotheses stay with their prompt).
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
