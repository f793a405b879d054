"""Process-group plumbing: the launcher of the distributed tests and ``scripts/bench_ring.py``,
and the rank watch of the training strategies.

``run_workers`` spawns one process per rank in a fresh process group (gloo on CPU, NCCL when
there is a GPU per rank) and collects each rank's result under a deadline.
``watch.RankWatch`` (imported by ``longnet.training.strategy``) keeps every rank's heartbeat in
the process group's store and names the ranks that stopped when a collective fails.
"""

from longnet.distributed.launch import backend_and_device, run_workers

__all__ = ["backend_and_device", "run_workers"]
