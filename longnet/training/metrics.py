"""Language-model metrics, exact across ranks and batches: summed cross-entropy, tokens and
UTF-8 bytes, so ``sum(CE) / sum(tokens)`` is one device's value on the whole split and bits per
byte compare byte and subword models (docs/training.md, "Pitfalls found here")."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from longnet.constants import IGNORE_INDEX, NATS_PER_BIT
from longnet.modeling.model import document_labels

Batch = dict[str, Tensor]
PASSKEY_ROWS = "passkey_rows"
"""Batch key of a ``(batch,)`` bool mask of the passkey windows (set by
:class:`~longnet.training.LengthCurriculum`); their loss is logged as ``train/passkey_loss``."""


def lm_summary(loss_sum: Tensor, num_tokens: Tensor, num_bytes: Tensor | None = None,
               bytes_per_token: float = 1.0) -> dict:
    """``loss`` (nats/token), ``bpb`` (bits/byte) and ``ppl`` (per token) from summed CE.

    Args:
        loss_sum: summed cross-entropy in nats (scalar or ``(batch,)``).
        num_tokens: number of scored tokens (same shape).
        num_bytes: UTF-8 bytes of text the scored tokens cover (same shape); None:
            ``bytes_per_token`` per token.
        bytes_per_token: bytes per token when ``num_bytes`` is None.
    """
    loss = loss_sum.double() / num_tokens.double().clamp(min=1)
    covered = num_tokens * bytes_per_token if num_bytes is None else num_bytes
    return {
        "loss": loss,
        "bpb": loss_sum.double() / NATS_PER_BIT / covered.double().clamp(min=1),
        "ppl": torch.exp(loss.clamp(max=80.0)),
    }


class TokenCrossEntropy(Metric):
    """Summed CE, scored tokens and their bytes (float64, summed across processes) from
    ``update(loss_sum, num_tokens, num_bytes)`` per batch or shard; ``compute()`` gives
    :func:`lm_summary`'s values, ``tokens`` and ``bytes``.

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
    """Share of scored tokens whose argmax prediction is the label; ``update(correct, total)``
    counts per batch or shard."""

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


def scored_labels(batch: Batch) -> Tensor:
    """``(batch, seq)`` labels less those whose target begins the next packed document."""
    return document_labels(batch["labels"], batch.get("document_ids"))


def passkey_ce(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
    """Summed CE and count (float64 scalars) of the scored tokens of the windows
    ``batch[PASSKEY_ROWS]`` marks (zeros without); logits ``(batch, seq, vocab)``."""
    marked = batch.get(PASSKEY_ROWS)
    if marked is None:
        zero = logits.new_zeros((), dtype=torch.float64)
        return zero, zero
    labels = scored_labels(batch)
    scored = marked.to(labels.device)[:, None] & (labels != IGNORE_INDEX)
    with torch.no_grad():
        ce = F.cross_entropy(logits[scored].float(), labels[scored], reduction="sum")
    return ce.double(), scored.sum().double()


def per_sample_ce(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample summed CE (float32) and scored tokens, ``(batch,)``, of ``(batch, seq)``."""
    ce = F.cross_entropy(
        logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def sample_mean_loss(logits: Tensor, labels: Tensor, world: int,
                     group: dist.ProcessGroup | None) -> Tensor:
    """This rank's share of the mean over samples of each whole sample's token-mean CE
    (after DDP's average): ``sum_b (sum_t CE[b, t] / n_b) * world * replicas / S``, ``n_b``
    over the sample's shards in ``group``, ``S`` the global batch's samples with a scored
    token. Logits ``(batch, shard, vocab)``, labels ``(batch, shard)``."""
    ce_sums, counts = per_sample_ce(logits, labels)
    replicas = 1  # ranks that hold a part of each sample
    if group is not None:
        dist.all_reduce(counts, group=group)
        replicas = dist.get_world_size(group)
    samples = (counts > 0).sum().double()
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(samples)
    per_sample = ce_sums / counts.clamp(min=1)
    return per_sample.sum() * (world * replicas / samples.clamp(min=1)).float()
