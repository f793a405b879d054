"""Counting inside a running ring by wrapping library functions (restored on exit).

* ``SendCounter``: payload bytes passed to ``torch.distributed.batch_isend_irecv``;
* ``KernelClock``: thread CPU seconds inside ``longnet.attention.kernels``' block kernels, and
  each call's shapes, which ``replay_seconds`` re-runs alone.

Both rely on the wrapped objects being looked up at call time (``dist.batch_isend_irecv`` by
the ring, ``kernels.KERNELS`` by ``kernels.select_kernel``, ``kernels.math_backward`` by
``Kernel.block_backward``).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist

from lab.bench.common import DTYPES
from longnet.attention import kernels


class SendCounter:
    """Counts payload bytes of ``isend``/``irecv`` ops passed to ``dist.batch_isend_irecv``
    while entered."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self._original = dist.batch_isend_irecv

    def __enter__(self) -> SendCounter:
        dist.batch_isend_irecv = self._count
        return self

    def __exit__(self, *exc) -> None:
        dist.batch_isend_irecv = self._original

    def _count(self, ops):
        for op in ops:
            size = op.tensor.numel() * op.tensor.element_size()
            if op.op is dist.isend:
                self.sent += size
            else:
                self.received += size
        return self._original(ops)

    def take(self) -> tuple[int, int]:
        """``(sent, received)`` since the last call."""
        counts = (self.sent, self.received)
        self.sent = self.received = 0
        return counts


class KernelClock:
    """Thread CPU seconds spent inside ``longnet``'s block kernels, and what each call was,
    while entered."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls: list[tuple] = []
        self._registry = kernels.KERNELS
        self._math_backward = kernels.math_backward

    def __enter__(self) -> KernelClock:
        kernels.KERNELS = tuple(
            replace(kernel, forward=self._timed(kernel.forward),
                    backward=self._timed(kernel.backward))
            for kernel in self._registry
        )
        kernels.math_backward = self._timed(self._math_backward)
        return self

    def __exit__(self, *exc) -> None:
        kernels.KERNELS = self._registry
        kernels.math_backward = self._math_backward

    def _timed(self, function):
        name = function.__name__

        def timed(*args, **kwargs):
            self.calls.append(kernel_call(name, args))
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed

    def take(self) -> tuple[float, list[tuple]]:
        """Seconds and calls since the last call."""
        seconds, calls = self.seconds, self.calls
        self.seconds, self.calls = 0.0, []
        return seconds, calls


def kernel_call(name: str, args: tuple) -> tuple:
    """``(kernel name, dtype, q shape, k shape, causal, scale)`` of one block-kernel call
    (forward: ``q, k, v, causal, scale``; backward: ``BlockBackward, causal, scale``)."""
    if name.endswith("forward"):
        q, k, _, causal, scale = args[:5]
    else:
        block, causal, scale = args[:3]
        q, k = block.q, block.k
    dtype = str(q.dtype).removeprefix("torch.")
    return name, dtype, tuple(q.shape), tuple(k.shape), causal, scale


def replay_seconds(calls: list[tuple]) -> float:
    """Thread CPU seconds of the recorded kernel ``calls`` re-run one after another in this
    process on one thread, on random blocks of the same shapes (the kernels' cost without other
    ranks competing for the cores; backward calls get the ``out``/``lse`` of a forward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seconds = 0.0
    try:
        for name, dtype, q_shape, k_shape, causal, scale in calls:
            forward = getattr(kernels, name.replace("backward", "forward"))
            q = torch.randn(q_shape, dtype=DTYPES[dtype])
            k, v = (torch.randn(k_shape, dtype=DTYPES[dtype]) for _ in range(2))
            if name.endswith("forward"):
                args = (q, k, v, causal, scale)
            else:
                out, lse = forward(q, k, v, causal, scale)
                args = (kernels.BlockBackward(torch.randn_like(q), q, k, v, out, lse), causal,
                        scale)
            start = time.thread_time()
            getattr(kernels, name)(*args)
            seconds += time.thread_time() - start
    finally:
        torch.set_num_threads(threads)
    return seconds
