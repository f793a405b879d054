"""Process-group plumbing: sequence parallelism applied to a model (``SequenceParallel``,
``parallelize``), the launcher of the distributed tests and ``lab/scripts/bench_ring.py``, and the
sequence-parallel Lightning strategies.

``SequenceParallel(process_group, layout, transport)`` says how each sequence is split over a
group of ranks (``layouts``: contiguous or zigzag shards); ``parallelize(model, sp)`` gives it
to every module of a model that reads it. ``run_workers`` spawns one process per rank in a fresh
process group (gloo on CPU, NCCL when there is a GPU per rank) and collects each rank's result
under a deadline. The Lightning side, imported from its modules (they import Lightning):
``strategy.SequenceParallelStrategy`` (DDP) and ``fsdp.ShardedSequenceParallelStrategy``
(FSDP2), which cut every batch into this rank's shard (``batches.shard_batch``) and name a lost
rank (``watch.RankWatch``).
"""

from longnet.distributed.launch import backend_and_device, run_workers
from longnet.distributed.sequence_parallel import SequenceParallel, parallelize

__all__ = ["SequenceParallel", "backend_and_device", "parallelize", "run_workers"]
