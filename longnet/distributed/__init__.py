"""Process-group plumbing beneath the attention core: ``SequenceParallel`` and ``parallelize``
(applied to a model), the shard layouts (``layouts``), the halo of a shard (``halo``) and the
rank watch (``watch``). The Lightning strategies are ``longnet.training``'s.
"""

from longnet.distributed.sequence_parallel import SequenceParallel, parallelize

__all__ = ["SequenceParallel", "parallelize"]
