"""Who computes with whose K/V block in a segment group, and how the blocks get there: both
transports, and the check that every rank made the same call.

A branch whose segments span ranks runs on each segment group (the members holding one
segment) as pieces (``plan.SpanningPiece``). :class:`Schedule` says which member computes with
which member's block, hop by hop; it is the one schedule of the forward, the backward and the
memory models. The ``ring`` transport moves every block one member on per hop (:func:`shift`);
the ``allgather`` transport gives every member every block at once and sends each dK/dV
partial to its owner (:class:`Peers`). Both use batched point-to-point calls
(``batch_isend_irecv``, peers mapped to global ranks so that subgroups work) and name the rank
and the step when a peer fails (docs/architecture.md §4).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import Tensor

from longnet.attention.plan import SpanningPiece
from longnet.distributed.sequence_parallel import TRANSPORTS


def transports_per_branch(transport: str | Sequence[str], num_branches: int) -> tuple[str, ...]:
    """One transport name per branch (``transport`` is one name for all or one per branch)."""
    transports = (transport,) * num_branches if isinstance(transport, str) else tuple(transport)
    if len(transports) != num_branches or any(t not in TRANSPORTS for t in transports):
        raise ValueError(
            f"dilated_attention: transport must be one of {TRANSPORTS} or a list of them, one "
            f"per branch ({num_branches}), got {transport!r}."
        )
    return transports


class Hop(NamedTuple):
    """One hop of the ``ring`` transport, seen from one member of a segment group."""

    number: int
    source: int  # the member whose K/V block this rank holds during the hop
    attended: bool  # whether this rank computes with that block
    last: bool  # no block arrives after this hop (nothing to post)


@dataclass(frozen=True)
class Schedule:
    """Who computes with whose K/V block in a segment group of ``size`` members, seen from
    member ``index``.

    Causal: a later member's keys are all in the future of an earlier member's queries, so
    member ``i`` computes with the blocks of members ``0..i`` only.
    """

    size: int
    index: int
    causal: bool

    def attends(self, reader: int, source: int) -> bool:
        """Whether member ``reader`` computes with member ``source``'s block."""
        return not (self.causal and source > reader)

    @property
    def sources(self) -> list[int]:
        """The members whose blocks this rank computes with, in member order."""
        return [source for source in range(self.size) if self.attends(self.index, source)]

    @property
    def readers(self) -> list[int]:
        """The other members that compute with this rank's block (``allgather``: each sends
        this rank a dK/dV partial in the backward)."""
        members = range(self.size)
        return [m for m in members if m != self.index and self.attends(m, self.index)]

    def hops(self) -> Iterator[Hop]:
        """``ring``: every block moves one member on per hop (member ``m`` sends to ``m + 1``,
        receives from ``m - 1``), so at hop ``h`` this rank holds member ``index - h``'s block.
        Every member joins every hop, attended or not (a member that skipped one would leave
        its peers waiting)."""
        for number in range(self.size):
            source = (self.index - number) % self.size
            yield Hop(number, source, self.attends(self.index, source), number + 1 == self.size)


class Peers:
    """Batched all-gather and reduce among the members of one segment group (the
    ``allgather`` transport; :func:`shift` runs the ``ring`` transport's hops).

    ``members``: the group ranks of the segment group in sequence order; ``index``: this rank's
    place among them; ``where``: how errors name this rank's step.
    """

    def __init__(
        self, process_group: dist.ProcessGroup, members: Sequence[int], index: int, where: str
    ) -> None:
        group_ranks = dist.get_process_group_ranks(process_group)
        self.process_group = process_group
        self.index = index
        self.ranks = [group_ranks[member] for member in members]
        self.where = f"rank {dist.get_rank()} ({where})"

    @staticmethod
    def post(ops: list[dist.P2POp], where: str) -> Callable[[], None]:
        """Start ``ops`` as one batch; returns a function that waits for all of them (and keeps
        their tensors alive until then), raising an error that names ``where`` (the rank and
        the step)."""
        works = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> None:
            try:
                for work in works:
                    work.wait()
            except Exception as error:  # a dead or mismatched peer: say who and where
                raise RuntimeError(f"dilated_attention: {where} failed: {error}") from error
            ops.clear()

        return wait

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every member's ``tensor`` (same shape everywhere), in member order."""
        gathered = [
            tensor if m == self.index else torch.empty_like(tensor) for m in range(len(self.ranks))
        ]
        ops = []
        for member, rank in enumerate(self.ranks):
            if member != self.index:
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), rank, self.process_group))
                ops.append(dist.P2POp(dist.irecv, gathered[member], rank, self.process_group))
        if ops:
            self.post(ops, f"{self.where} at all-gather among ranks {self.ranks}")()
        return gathered

    def reduce_to_owners(self, partials: list[Tensor | None], schedule: Schedule) -> Tensor:
        """Send ``partials[m]`` (None: none, this rank did not compute with ``m``'s block) to
        member ``m``; return the sum of the partials for this rank's block, received from
        ``schedule.readers``."""
        total = partials[self.index].clone()
        readers = schedule.readers
        received, ops = [], []
        for member, rank in enumerate(self.ranks):
            if member != self.index and partials[member] is not None:
                ops.append(dist.P2POp(dist.isend, partials[member], rank, self.process_group))
            if member in readers:
                buffer = torch.empty_like(total)
                received.append(buffer)
                ops.append(dist.P2POp(dist.irecv, buffer, rank, self.process_group))
        if ops:
            self.post(ops, f"{self.where} at reduce among ranks {self.ranks}")()
        for buffer in received:
            total += buffer
        return total


def shift(process_group: dist.ProcessGroup, moves: Sequence[tuple[SpanningPiece, Tensor]],
          hop: int, kind: int, label: str) -> Callable[[], list[Tensor]]:
    """One hop of the ``ring`` transport: for every ``(member, tensor)`` of ``moves``, send the
    tensor to the next member of its segment group and receive the previous member's; returns
    a function that waits and gives the received tensors, in order. A message between two
    members on this rank is handed over without a send. Messages are posted in one order on
    both sides of every pair of ranks (by sender and receiver member) and tagged by receiver
    and ``kind`` (0: K/V, 1: dK/dV), so that two on one link cannot be confused."""
    me = dist.get_rank(process_group)
    global_ranks = dist.get_process_group_ranks(process_group)
    handed: dict[tuple[tuple[int, ...], int], Tensor] = {}
    received: list[Tensor | None] = [None] * len(moves)
    ops: list[tuple[tuple[int, int], dist.P2POp]] = []
    for i, (piece, tensor) in enumerate(moves):
        size, index = len(piece.members), piece.index
        if size == 1:
            received[i] = tensor
            continue
        after, before = (index + 1) % size, (index - 1) % size
        if piece.hosts[after] == me:
            handed[piece.members, after] = tensor
        else:
            tag = kind + 2 * piece.members[after]
            peer = global_ranks[piece.hosts[after]]
            op = dist.P2POp(dist.isend, tensor.contiguous(), peer, process_group, tag)
            ops.append(((piece.members[index], piece.members[after]), op))
        if piece.hosts[before] != me:
            received[i] = torch.empty_like(tensor)
            tag = kind + 2 * piece.members[index]
            peer = global_ranks[piece.hosts[before]]
            op = dist.P2POp(dist.irecv, received[i], peer, process_group, tag)
            ops.append(((piece.members[before], piece.members[index]), op))
    for i, (piece, _) in enumerate(moves):
        if received[i] is None:
            received[i] = handed[piece.members, piece.index]
    ops.sort(key=lambda entry: entry[0])
    where = f"rank {dist.get_rank()} ({label}) at hop {hop}"
    wait = Peers.post([op for _, op in ops], where)
    return lambda: (wait(), received)[1]


_AGREED: WeakKeyDictionary[dist.ProcessGroup, dict[tuple[str, int], int]] = WeakKeyDictionary()
"""The calls each process group agreed on: ``(signature, block budget) -> agreed budget``."""


def agree_on_call(
    signature: str, block_elements: int, process_group: dist.ProcessGroup, device: torch.device
) -> int:
    """Raise on every rank if any rank of ``process_group`` called with a different
    ``signature``; return the smallest ``block_elements`` of the group (every member of a
    segment group must cut a branch into the same pieces).

    One all-reduce and one host sync the first time a group meets a signature; the answer is
    kept for the group's lifetime, so later calls with that signature cost nothing (a rank
    that later calls with a signature the others do not share is then caught by the exchange
    itself, not here)."""
    agreed = _AGREED.setdefault(process_group, {})
    key = (signature, block_elements)
    if key not in agreed:
        agreed[key] = _all_agree(signature, block_elements, process_group, device)
    return agreed[key]


def _all_agree(
    signature: str, block_elements: int, process_group: dist.ProcessGroup, device: torch.device
) -> int:
    """The all-reduce of :func:`agree_on_call`."""
    code = zlib.crc32(signature.encode())
    values = torch.tensor([code, -code, -block_elements], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
    if values[0].item() != code or -values[1].item() != code:
        raise ValueError(
            f"dilated_attention: rank {dist.get_rank(process_group)} of the sequence-parallel "
            f"group was called with ({signature}) but another rank passed different shapes, "
            "dtype, pattern or options; every rank must pass equal-length shards and the same "
            "arguments."
        )
    return int(-values[2].item())
