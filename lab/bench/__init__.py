"""The benchmark harnesses behind ``lab.scripts.bench_attention`` and ``lab.scripts.bench_ring``.

* ``common``: the shared plumbing (peak memory, float64 reference rows, machine and code
  description, formatting and tables, rewriting blocks of ``docs/benchmarks.md``, plotting);
* ``attention``: dilated attention against dense SDPA and ``dilated-attention-pytorch`` on
  one device;
* ``ring``: the sequence-parallel ring across spawned process groups;
* ``instrument``: counters that wrap library functions inside the ring's ranks;
* ``peers``: adapters for the peer libraries compared against.

What is measured and the targets it is read against: ``docs/benchmarks.md``. This package may
import the rest of ``longnet``; nothing in ``longnet`` imports it.
"""
