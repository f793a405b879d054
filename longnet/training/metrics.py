"""Token-weighted language-modelling metrics that are exact across ranks and batches.

Cross-entropy is accumulated as a *sum* over scored tokens together with the number of scored
tokens, both as torchmetrics states reduced by summation, so the epoch value is
``sum(CE) / sum(tokens)`` over every token of every rank, exactly what one device would
compute on the whole split. Perplexity is derived from that mean (never from a materialised
softmax: see docs/training.md, "Pitfalls found here"), per token. Bits per byte divide the
summed cross-entropy by the UTF-8 bytes of the text the scored tokens cover, counted per token
by the data (``label_bytes``; for byte text one per scored byte, none for an EOS), so a byte
model and a subword model are compared on the same bytes.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torchmetrics import Metric

from longnet.constants import NATS_PER_BIT


def lm_summary(loss_sum: Tensor, num_tokens: Tensor, num_bytes: Tensor | None = None,
               bytes_per_token: float = 1.0) -> dict:
    """``loss`` (nats per token), ``bpb`` (bits per byte) and ``ppl`` (per token) from summed
    CE.

    Args:
        loss_sum: summed cross-entropy in nats (scalar or ``(batch,)``).
        num_tokens: number of scored tokens (same shape).
        num_bytes: UTF-8 bytes of text the scored tokens cover (same shape); None:
            ``bytes_per_token`` per token. A number here is taken as ``bytes_per_token`` (the
            third argument before bytes were counted), with a ``FutureWarning``.
        bytes_per_token: bytes per token when ``num_bytes`` is None.
    """
    if num_bytes is not None and not isinstance(num_bytes, Tensor):
        warnings.warn(
            "lm_summary's third argument is now num_bytes (a tensor of the bytes the scored "
            f"tokens cover); {num_bytes!r} is taken as bytes_per_token: pass "
            "bytes_per_token= instead.", FutureWarning, stacklevel=2)
        num_bytes, bytes_per_token = None, float(num_bytes)
    loss = loss_sum.double() / num_tokens.double().clamp(min=1)
    covered = num_tokens * bytes_per_token if num_bytes is None else num_bytes
    return {
        "loss": loss,
        "bpb": loss_sum.double() / NATS_PER_BIT / covered.double().clamp(min=1),
        "ppl": torch.exp(loss.clamp(max=80.0)),
    }


class TokenCrossEntropy(Metric):
    """Summed cross-entropy, scored tokens and the bytes they cover; ``compute()`` gives loss
    (nats per token), bpb (bits per byte), perplexity (per token), tokens and bytes.

    ``update(loss_sum, num_tokens, num_bytes)`` takes the scalar outputs of
    :class:`longnet.modeling.LongNetLM` (``LMOutput.loss_sum`` / ``LMOutput.num_tokens``) for
    one batch (or one sequence shard) and the UTF-8 bytes its scored tokens cover (None:
    ``bytes_per_token`` per token). States are float64 and reduced with ``sum`` across
    processes, so sequence shards and data-parallel replicas add up to the exact global value.

    Args:
        bytes_per_token: bytes per token for updates without ``num_bytes``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, bytes_per_token: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token!r}.")
        self.bytes_per_token = float(bytes_per_token)
        for name in ("loss_sum", "num_tokens", "num_bytes"):
            self.add_state(name, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, num_tokens: Tensor, num_bytes: Tensor | None = None) -> None:
        self.loss_sum += loss_sum.detach().to(torch.float64)
        self.num_tokens += num_tokens.detach().to(torch.float64)
        covered = num_tokens * self.bytes_per_token if num_bytes is None else num_bytes
        self.num_bytes += covered.detach().to(torch.float64)

    def compute(self) -> dict:
        return {
            **lm_summary(self.loss_sum, self.num_tokens, self.num_bytes),
            "tokens": self.num_tokens,
            "bytes": self.num_bytes,
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
