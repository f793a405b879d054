"""Model outputs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class LMOutput:
    """Output of :class:`LongNetLM`.

    logits: ``(batch, seq, vocab_size)``.
    loss: mean cross-entropy over the tokens whose label is not -100 (0 when there are none);
        ``None`` without labels.
    loss_sum, num_tokens: the summed cross-entropy (float32 or float64) and the number of
        counted tokens (int64 scalar), for exact aggregation across ranks / batches.
    """

    logits: Tensor
    loss: Tensor | None = None
    loss_sum: Tensor | None = None
    num_tokens: Tensor | None = None


@dataclass
class EncoderOutput:
    """Output of :class:`LongNetEncoder`.

    logits: ``(batch, num_labels)``; pooled: ``(batch, hidden_size)``;
    hidden_states: ``(batch, seq, hidden_size)`` after the final norm;
    loss: mean cross-entropy of ``labels`` ``(batch,)`` (``None`` without labels).
    """

    logits: Tensor
    pooled: Tensor
    hidden_states: Tensor
    loss: Tensor | None = None
