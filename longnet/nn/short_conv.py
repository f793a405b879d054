"""A causal depthwise convolution along the sequence, for keys and values.

With ``kernel_size >= r`` a far token reaches every offset modulo the dilation rate ``r``
(docs/architecture.md §2, "Alignment"); it starts as the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from longnet.validation import check_positive_int, describe, is_int


def check_kv_conv_size(value: Any) -> int:
    """``kv_conv_size`` as an ``int`` if it is 0 (none) or at least 2, else ``ValueError``."""
    if not is_int(value) or value == 1 or value < 0:
        raise ValueError(
            f"kv_conv_size must be 0 (no convolution) or an integer of at least 2, got "
            f"{describe(value)}."
        )
    return int(value)


class CausalShortConv(nn.Module):
    """``y[t] = sum_j weight[:, j] * x[t - j]`` for ``j = 0 .. kernel_size - 1``, per channel.

    Earlier rows: ``history`` ``(batch, kernel_size - 1, channels)`` or zeros; ``positions``
    ``(batch, seq)`` keeps ``j <= positions[t]``. Shapes: ``(batch, seq, channels)`` -> same.
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
        """The sum over taps ``j <= positions[t]``, masked by replacing (rows may hold NaN)."""
        width, seq = self.kernel_size - 1, positions.shape[1]
        weight = self.weight.to(rows.dtype)
        out = rows[:, width:] * weight[:, 0]
        for j in range(1, self.kernel_size):
            tap = rows[:, width - j : width - j + seq].masked_fill((positions < j)[..., None], 0)
            out = out + tap * weight[:, j]
        return out
