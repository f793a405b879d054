"""Process-group plumbing beneath the attention core: ``SequenceParallel`` and ``parallelize``
(applied to a model), the shard layouts (``layouts``), the halo of a shard (``halo``), the rank
watch (``watch``) and ``run_workers``, one process per rank under a deadline (the distributed
tests, ``lab/scripts/bench_ring.py``). The Lightning strategies are ``longnet.training``'s.
"""

from longnet.distributed.launch import backend_and_device, run_workers
from longnet.distributed.sequence_parallel import SequenceParallel, parallelize

__all__ = ["SequenceParallel", "backend_and_device", "parallelize", "run_workers"]
