"""Sequence parallelism: ``SequenceParallel`` and ``parallelize`` (applied to a model), and
``run_workers``, one process per rank (the distributed tests, ``lab/scripts/bench_ring.py``).
The Lightning strategies are imported from their modules (they import Lightning):
``strategy.SequenceParallelStrategy`` (DDP) and ``fsdp.ShardedSequenceParallelStrategy`` (FSDP2).
"""

from longnet.distributed.launch import backend_and_device, run_workers
from longnet.distributed.sequence_parallel import SequenceParallel, parallelize

__all__ = ["SequenceParallel", "backend_and_device", "parallelize", "run_workers"]
