"""The bidirectional LongNet encoder: the shared backbone, pooling and a classification head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.modeling.config import LongNetConfig
from longnet.modeling.model import LongNetModel, LongNetPreTrained, check_label_ids


@dataclass
class EncoderOutput:
    """Output of :class:`LongNetEncoder`: logits ``(batch, num_labels)``, pooled ``(batch,
    hidden_size)``, hidden_states ``(batch, seq, hidden_size)``, loss (None without labels)."""

    logits: Tensor
    pooled: Tensor
    hidden_states: Tensor
    loss: Tensor | None = None


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; the gradient is summed too (every rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: torch.distributed.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LongNetEncoder(LongNetPreTrained):
    """Bidirectional encoder with a pooled classification head.

    ``pooling`` (config): ``"mean"``, ``"first"`` or ``"last"``. There is no padding mask:
    batch sequences of equal length.

    Attributes:
        sequence_parallel: as :class:`LongNetModel`'s; pooling then spans all shards.
    """

    sequence_parallel: SequenceParallel | None

    def __init__(self, config: LongNetConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = LongNetModel(config, causal=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights()
        self.sequence_parallel = None

    def pool(
        self, hidden: Tensor, sequence_parallel: SequenceParallel | None = None
    ) -> Tensor:
        """``(batch, seq, hidden)`` -> ``(batch, hidden)``, over all shards."""
        pooling = self.config.pooling
        if sequence_parallel is None or sequence_parallel.world_size == 1:
            if pooling == "mean":
                return hidden.mean(dim=1)
            return hidden[:, 0] if pooling == "first" else hidden[:, -1]
        group = sequence_parallel.process_group
        rank, world = sequence_parallel.rank, sequence_parallel.world_size
        if pooling == "mean":
            local = hidden.sum(dim=1) / (hidden.shape[1] * world)
        else:
            # The last token is on the last rank (contiguous) or rank 0 (zigzag). Other ranks
            # multiply by 0, not zeros: their graph must reach the blocks' communicating backward.
            owner = world - 1 if pooling == "last" and sequence_parallel.layout == "contiguous" \
                else 0
            local = hidden[:, 0 if pooling == "first" else -1] * float(rank == owner)
        return _AllReduceSum.apply(local, group)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> EncoderOutput:
        """Class logits ``(batch, num_labels)``; with ``labels`` ``(batch,)`` the mean loss."""
        hidden = self.model(input_ids, position_ids=position_ids)
        pooled = self.pool(hidden, self.sequence_parallel)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            check_label_ids(labels, self.config.num_labels, "num_labels", ignore=False)
            if labels.shape != (input_ids.shape[0],):
                raise ValueError(
                    f"labels must have shape ({input_ids.shape[0]},) (one class per row), got "
                    f"{tuple(labels.shape)}."
                )
            compute = torch.promote_types(logits.dtype, torch.float32)
            loss = F.cross_entropy(logits.to(compute), labels.long())
        return EncoderOutput(logits=logits, pooled=pooled, hidden_states=hidden, loss=loss)
