"""Process-group plumbing shared by the distributed tests and ``scripts/bench_ring.py``.

``run_workers`` spawns one process per rank in a fresh process group (gloo on CPU, NCCL when
there is a GPU per rank) and collects each rank's result under a deadline. Nothing else in
``longnet`` imports this package.
"""

from longnet.distributed.launch import backend_and_device, run_workers

__all__ = ["backend_and_device", "run_workers"]
