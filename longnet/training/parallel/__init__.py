"""Training over ranks: the Lightning strategies that split each sequence over a
sequence-parallel group (``SequenceParallelStrategy``: DDP x sequence parallelism;
``ShardedSequenceParallelStrategy``: FSDP2 x sequence parallelism) and the batch sharding they
share (:func:`shard_batch`). The process-group plumbing beneath them is ``longnet.distributed``."""

from longnet.training.parallel.batches import pad_sequences, shard_batch
from longnet.training.parallel.fsdp import ShardedModule, ShardedSequenceParallelStrategy
from longnet.training.parallel.strategy import (
    SequenceParallelLayout,
    SequenceParallelModule,
    SequenceParallelStrategy,
)

__all__ = [
    "SequenceParallelLayout",
    "SequenceParallelModule",
    "SequenceParallelStrategy",
    "ShardedModule",
    "ShardedSequenceParallelStrategy",
    "pad_sequences",
    "shard_batch",
]
