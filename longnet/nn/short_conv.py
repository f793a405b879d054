"""A causal depthwise convolution along the sequence, for keys and values.

Dilated attention shows a query at position ``p`` the far keys at positions ``= p (mod r)``
only (docs/architecture.md §2, "Alignment"), so a token copied from far away is found only
when it sits at the right offset.  Mixing each key/value row with the ``kernel_size - 1``
rows before it puts every token into ``kernel_size`` consecutive rows, one of them at each
offset when ``kernel_size >= r``, so a far token can be found whatever its offset (whether
a model learns to use that is a matter of training: docs/training.md).
The weights start as the identity (``weight[:, 0] = 1``), so adding the layer to a trained
model leaves its function unchanged until training moves them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from longnet.validation import check_positive_int, describe, is_int


def check_kv_conv_size(value: Any) -> int:
    """``kv_conv_size`` (the width of a K/V convolution; 0: none) as an ``int`` if it is 0 or
    an integer of at least 2 (a width of 1 would only scale the rows), else ``ValueError``."""
    if not is_int(value) or value == 1 or value < 0:
        raise ValueError(
            f"kv_conv_size must be 0 (no convolution) or an integer of at least 2, got "
            f"{describe(value)}."
        )
    return int(value)


class CausalShortConv(nn.Module):
    """``y[t] = sum_j weight[:, j] * x[t - j]`` for ``j = 0 .. kernel_size - 1``, per channel.

    Rows before the first are ``history`` (the last ``kernel_size - 1`` rows of the sequence
    before this chunk: the previous rank's shard, or a decoding cache's tail) or zeros.
    With packed documents, ``positions`` (each row's position in its document,
    ``nn.document_position_ids``) limits the sum to ``j <= positions[t]``: no row is mixed
    with a row of another document.

    Shapes: ``x`` ``(batch, seq, channels)``, ``history`` ``(batch, kernel_size - 1,
    channels)``, ``positions`` ``(batch, seq)``; returns ``(batch, seq, channels)``.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.channels = check_positive_int("channels", channels)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        self.weight = nn.Parameter(torch.empty(self.channels, self.kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: ``y = x``."""
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, 0] = 1.0

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"

    def forward(
        self, x: Tensor, history: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        batch, _, channels = x.shape
        width = self.kernel_size - 1
        if history is None:
            history = x.new_zeros(batch, width, channels)
        elif tuple(history.shape) != (batch, width, channels):
            raise ValueError(
                f"CausalShortConv: history has shape {tuple(history.shape)}, expected "
                f"{(batch, width, channels)} (the {width} rows before x)."
            )
        rows = torch.cat((history.to(x.dtype), x), dim=1)
        if positions is not None:
            return self._within_documents(rows, positions)
        padded = rearrange(rows, "b n c -> b c n")
        # conv1d correlates: output t reads input t + i, i.e. x[t - (width - i)].
        kernel = rearrange(self.weight.flip(-1), "c k -> c 1 k").to(x.dtype)
        return rearrange(F.conv1d(padded, kernel, groups=channels), "b c n -> b n c")

    def _within_documents(self, rows: Tensor, positions: Tensor) -> Tensor:
        """The sum over taps ``j <= positions[t]`` of ``rows`` ``(batch, width + seq,
        channels)`` (history, then ``x``), one masked tap at a time (a masked row may hold
        anything, even a NaN: it is replaced, not multiplied by 0)."""
        width, seq = self.kernel_size - 1, positions.shape[1]
        weight = self.weight.to(rows.dtype)
        out = rows[:, width:] * weight[:, 0]
        for j in range(1, self.kernel_size):
            tap = rows[:, width - j : width - j + seq].masked_fill((positions < j)[..., None], 0)
            out = out + tap * weight[:, j]
        return out
