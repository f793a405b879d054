"""Token-weighted language-modelling metrics that are exact across ranks and batches.

Cross-entropy is accumulated as a *sum* over scored tokens together with the number of scored
tokens, both as torchmetrics states reduced by summation, so the epoch value is
``sum(CE) / sum(tokens)`` over every token of every rank, exactly what one device would
compute on the whole split. Perplexity and bits per byte are derived from that mean (never
from a materialised softmax: see docs/training.md, "Pitfalls found here").
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from longnet.constants import NATS_PER_BIT


def lm_summary(loss_sum: Tensor, num_tokens: Tensor, bytes_per_token: float = 1.0) -> dict:
    """``loss`` (nats per token), ``bpb`` (bits per byte) and ``ppl`` from summed CE.

    Args:
        loss_sum: summed cross-entropy in nats (scalar).
        num_tokens: number of scored tokens (scalar).
        bytes_per_token: bytes of text per token (1 for the byte-level tokenizer).
    """
    loss = loss_sum.double() / num_tokens.double().clamp(min=1)
    return {
        "loss": loss,
        "bpb": loss / (NATS_PER_BIT * bytes_per_token),
        "ppl": torch.exp(loss.clamp(max=80.0)),
    }


class TokenCrossEntropy(Metric):
    """Summed cross-entropy and scored-token count; ``compute()`` gives loss, bpb, perplexity.

    ``update(loss_sum, num_tokens)`` takes the scalar outputs of
    :class:`longnet.modeling.LongNetLM` (``LMOutput.loss_sum`` / ``LMOutput.num_tokens``) for
    one batch (or one sequence shard). States are float64 and reduced with ``sum`` across
    processes, so sequence shards and data-parallel replicas add up to the exact global value.

    Args:
        bytes_per_token: bytes of text per token, for bits per byte (1 for byte-level models).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, bytes_per_token: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token!r}.")
        self.bytes_per_token = float(bytes_per_token)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, num_tokens: Tensor) -> None:
        self.loss_sum += loss_sum.detach().to(torch.float64)
        self.num_tokens += num_tokens.detach().to(torch.float64)

    def compute(self) -> dict:
        return {
            **lm_summary(self.loss_sum, self.num_tokens, self.bytes_per_token),
            "tokens": self.num_tokens,
        }


class TokenAccuracy(Metric):
    """Share of scored tokens whose argmax prediction equals the label (exact across ranks).

    ``update(correct, num_tokens)`` takes counts of one batch or shard.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: Tensor, total: Tensor) -> None:
        self.correct += correct.detach().to(torch.float64)
        self.total += total.detach().to(torch.float64)

    def compute(self) -> Tensor:
        return self.correct / self.total.clamp(min=1)
