"""Left padding read from ``transformers``' attention masks, and the rows that share it.

Dilated segments are laid out from position 0, so a row is exact only from its first token: a
left-padded batch runs as groups of rows of equal padding, without it (:func:`row_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowGroup:
    """Batch rows ``rows`` ``(n,)`` (int64, ascending), each with ``padding`` leading padding
    columns."""

    rows: Tensor
    padding: int


def left_padding(attention_mask: Tensor, batch: int, length: int) -> Tensor:
    """Per row, the number of leading padding columns ``(batch,)`` (int64) of a
    ``(batch, length)`` mask of ones (tokens) and zeros (padding).

    Raises:
        ValueError: a mask of another shape or with other values, a 0 after a 1 in a row
            (right or inner padding), or a row without any token.
    """
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({batch}, "
            f"{length}): one column per token of the sequence, cached tokens included."
        )
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    tokens = attention_mask == 1
    padding = (tokens.long().cumsum(dim=1) == 0).sum(dim=1)
    inner = tokens.sum(dim=1) != length - padding
    if bool(inner.any()):
        row = int(inner.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding after a token; LongNet supports left "
            "padding only (tokenizer padding_side='left'). For scoring, right padding needs "
            "no mask at all: a causal model never looks at later positions."
        )
    if bool((padding == length).any()):
        row = int((padding == length).nonzero()[0])
        raise ValueError(f"attention_mask row {row} has no token; remove the empty row.")
    return padding


def row_groups(padding: Tensor) -> list[RowGroup]:
    """The rows of each distinct padding ``(batch,)``, by increasing padding."""
    return [
        RowGroup(rows=(padding == value).nonzero().flatten(), padding=int(value))
        for value in torch.unique(padding).tolist()
    ]
