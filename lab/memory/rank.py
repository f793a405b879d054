"""Per-rank and per-group totals of an attention memory plan.

Each phase's peak is the sum of the tensors alive in it: the persistent tensors
(``persistent_bytes``: saved ``out``/``lse``, accumulators, gradient buffers), the local
branches' chunks (``local_forward_workspace``, ``local_backward_workspace``), and per spanning
branch, one piece at a time, its messages, dK/dV buffers and block work
(``spanning_branch_memory``). For bfloat16 the CPU kernel's own reduced-precision packing
buffers are not modelled (the forward peak of a large dense block comes out low; the backward
peak, which dominates, is close).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lab.memory.local import local_backward_workspace, local_forward_workspace
from lab.memory.ring import SpanningBranchMemory, spanning_branch_memory, spanning_branches
from lab.memory.setup import AttentionSetup


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank for one forward + backward call (above q, k, v and the upstream
    gradient, which the caller owns)."""

    rank: int
    saved_qkv_bytes: int  # q, k, v kept for backward (the inputs themselves: no extra memory)
    saved_out_bytes: int
    saved_lse_bytes: int
    grad_bytes: int  # dq, dk, dv accumulators (+ input-dtype casts when s != a)
    local_forward_bytes: int  # local chunk workspace, forward
    local_backward_bytes: int  # local chunk workspace, backward
    branches: tuple[SpanningBranchMemory, ...]
    forward_peak_bytes: int
    backward_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Peak extra bytes of the whole call (forward or backward, whichever is larger)."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def saved_bytes(self) -> int:
        """Activations kept from forward to backward that the call allocates (out, lse)."""
        return self.saved_out_bytes + self.saved_lse_bytes

    @property
    def message_bytes(self) -> int:
        """Largest packed K/V message of any spanning branch (0 without any)."""
        return max((b.message_bytes for b in self.branches), default=0)

    @property
    def kv_buffer_bytes(self) -> int:
        """Largest peak of K/V messages and receive buffers / all-gather blocks."""
        return max((b.kv_buffer_bytes for b in self.branches), default=0)

    @property
    def dkv_buffer_bytes(self) -> int:
        """Largest peak of travelling dK/dV accumulators / partials and reduce buffers."""
        return max((b.dkv_buffer_bytes for b in self.branches), default=0)

    @property
    def sent_forward_bytes(self) -> int:
        return sum(b.sent_forward_bytes for b in self.branches)

    @property
    def sent_backward_bytes(self) -> int:
        return sum(b.sent_backward_bytes for b in self.branches)

    @property
    def received_forward_bytes(self) -> int:
        return sum(b.received_forward_bytes for b in self.branches)

    @property
    def received_backward_bytes(self) -> int:
        return sum(b.received_backward_bytes for b in self.branches)


def persistent_bytes(setup: AttentionSetup) -> tuple[int, int, int, int]:
    """``(forward accumulators, saved out, saved lse, gradient buffers)`` in bytes.

    Forward: ``out`` (``E a``) and ``lse`` accumulators. Saved: ``out`` in the input dtype (the
    accumulator itself when ``s == a``) and the accumulator ``lse``. Backward: ``dq, dk, dv``
    accumulators ``3 E a``, cast to the input dtype at the end (``3 E s`` more when ``s != a``).
    """
    e, s, a = setup.shard_elements, setup.input_size, setup.acc_size
    lse = setup.lse_elements * a
    casts = 3 * e * s if s != a else 0
    return e * a + lse, e * s, lse, 3 * e * a + casts


def rank_memory(
    setup: AttentionSetup, rank: int, local: tuple[int, int] | None = None
) -> RankMemory:
    """All memory terms of ``rank``; ``local`` = precomputed ``(local fwd, local bwd)`` workspace.

    Forward peak = accumulators + max(local workspace, each spanning branch's forward), or at
    the end: accumulators + the returned lse copy (+ the ``out`` cast when ``s != a``). Backward
    peak = saved out, lse + gradient accumulators + max(local workspace, each spanning
    branch's backward), or at the end + the gradient casts.
    """
    if local is None:
        local = (local_forward_workspace(setup), local_backward_workspace(setup))
    accumulators, saved_out, saved_lse, grads = persistent_bytes(setup)
    branches = tuple(
        spanning_branch_memory(setup, segment, rate, transport, rank)
        for segment, rate, transport in spanning_branches(setup)
    )
    e, s, a = setup.shard_elements, setup.input_size, setup.acc_size
    lse = setup.lse_elements * a
    forward_work = max([local[0], *(b.forward_bytes for b in branches)])
    forward_end = accumulators + lse + (e * s if s != a else 0)
    forward_peak = max(accumulators + forward_work, forward_end)
    backward_work = max([local[1], *(b.backward_bytes for b in branches)])
    accumulators_bwd = 3 * e * a
    backward_peak = saved_out + saved_lse + max(accumulators_bwd + backward_work, grads)
    return RankMemory(
        rank=rank,
        saved_qkv_bytes=3 * e * s,
        saved_out_bytes=saved_out,
        saved_lse_bytes=saved_lse,
        grad_bytes=grads,
        local_forward_bytes=local[0],
        local_backward_bytes=local[1],
        branches=branches,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
    )


# -- whole group ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory of one call on every rank of the group; summaries are worst-rank."""

    setup: AttentionSetup
    ranks: tuple[RankMemory, ...] = field(repr=False)

    @property
    def peak_bytes(self) -> int:
        """Largest per-rank peak extra bytes."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def worst_rank(self) -> RankMemory:
        """The rank with the largest peak."""
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def sent_bytes_max(self) -> tuple[int, int]:
        """Largest ``(forward, backward)`` bytes any rank sends."""
        return (
            max(r.sent_forward_bytes for r in self.ranks),
            max(r.sent_backward_bytes for r in self.ranks),
        )

    @property
    def sent_bytes_mean(self) -> tuple[float, float]:
        """Mean ``(forward, backward)`` bytes sent per rank."""
        count = len(self.ranks)
        return (
            sum(r.sent_forward_bytes for r in self.ranks) / count,
            sum(r.sent_backward_bytes for r in self.ranks) / count,
        )


def plan_memory(setup: AttentionSetup, ranks: Sequence[int] | None = None) -> MemoryPlan:
    """``RankMemory`` for ``ranks`` (default: every rank of the group)."""
    local = (local_forward_workspace(setup), local_backward_workspace(setup))
    chosen = range(setup.world_size) if ranks is None else ranks
    return MemoryPlan(setup, tuple(rank_memory(setup, rank, local) for rank in chosen))


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units (``"1.50 GiB"``)."""
    if count < 1024:
        return f"{count:.0f} B"
    exponent = min(int(math.log(count, 1024)), 5)
    return f"{count / 1024**exponent:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB')[exponent]}"

