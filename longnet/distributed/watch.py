"""Which rank of a process group stopped: per-rank heartbeats in the group's rendezvous store.

A killed rank leaves its peers only a closed socket ("Connection closed by peer", a port, not a
rank). Every rank records ``pid P on host H`` in the default group's store and bumps a counter
every :data:`HEARTBEAT_SECONDS`; a failing rank marks its error, and ranks silent for
:data:`SILENCE_SECONDS` are gone: after an error if marked, else lost. A store that stops
answering means its host is gone (rank 0, or torchrun's agent on node 0).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import torch.distributed as dist

HEARTBEAT_SECONDS = 0.5
SILENCE_SECONDS = 3.0
"""A rank whose heartbeat counter does not move for this long is gone (six heartbeats)."""
STOP_SECONDS = 10.0
"""How long :meth:`RankWatch.stop` waits for the beating thread (a store call in flight)."""
PREFIX = "longnet/watch"
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def store_host_rank() -> int | None:
    """The rank hosting the default group's store: 0, or None when torchrun's agent does."""
    return None if os.environ.get(AGENT_STORE, "").lower() == "true" else 0


class RankWatch:
    """Heartbeats of every rank of a process group in its store; names the ranks that stopped.

    Args:
        store: a store every rank reaches (the default group's, :meth:`start`).
        rank, world_size: this rank and the number of ranks.
        store_host: the rank whose process hosts ``store`` (None: another process).
        heartbeat_seconds, silence_seconds: beat interval; silence that counts as gone.

    Each watch opens a fresh key space: the same ranks can run several in turn, in one order.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        store_host: int | None = 0,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        silence_seconds: float = SILENCE_SECONDS,
    ) -> None:
        generation = store.add(f"{PREFIX}/starts/{rank}", 1)
        self.store = dist.PrefixStore(f"{PREFIX}/{generation}", store)
        self.rank, self.world_size, self.store_host = rank, world_size, store_host
        self.heartbeat_seconds, self.silence_seconds = heartbeat_seconds, silence_seconds
        self.who: dict[int, str] = {rank: f"pid {os.getpid()} on {socket.gethostname()}"}
        self.store.set(f"who/{rank}", self.who[rank])
        self.learn_others()  # the ranks already here are known even if this process stalls
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"longnet-rank-watch-{rank}", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(cls, **kwargs) -> RankWatch:
        """A watch over the default process group (its store, rank and size)."""
        store = dist.distributed_c10d._get_default_store()
        return cls(
            store, dist.get_rank(), dist.get_world_size(), store_host=store_host_rank(), **kwargs
        )

    def stop(self) -> None:
        """Stop beating (the others will count this rank as gone; mark a failure first)."""
        self._stop.set()
        self._thread.join(timeout=STOP_SECONDS)

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(f"beat/{self.rank}", 1)
                self.learn_others()
            except Exception:  # noqa: BLE001 - the store is gone: explain() will say so
                return
            if self._stop.wait(self.heartbeat_seconds):
                return

    def learn_others(self) -> None:
        """Read the ``pid on host`` records of the ranks not known yet (every heartbeat; call
        it once all ranks have started to know them all)."""
        for rank in range(self.world_size):
            key = f"who/{rank}"
            if rank not in self.who and self.store.check([key]):
                self.who[rank] = self.store.get(key).decode()

    def describe(self, rank: int) -> str:
        """``rank N (pid P on host H)``, as far as known."""
        return f"rank {rank} ({self.who[rank]})" if rank in self.who else f"rank {rank}"

    def mark_failed(self, error: BaseException) -> None:
        """Tell the others this rank stops because of ``error`` (its first line)."""
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
        with contextlib.suppress(Exception):  # the store is gone: nothing to tell
            self.store.set(f"failed/{self.rank}", reason)

    def stopped(self) -> list[str]:
        """One sentence per rank that is gone, the lost ones first; empty when every other
        rank still beats. Takes :data:`SILENCE_SECONDS`."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            before = {rank: self.store.add(f"beat/{rank}", 0) for rank in others}
            time.sleep(self.silence_seconds)
            gone = [rank for rank in others if self.store.add(f"beat/{rank}", 0) == before[rank]]
            reasons = {
                rank: self.store.get(f"failed/{rank}").decode()
                for rank in gone
                if self.store.check([f"failed/{rank}"])
            }
        except Exception:  # noqa: BLE001 - DistNetworkError & co: the store no longer answers
            if self.store_host is None:
                return [
                    "the process group's rendezvous store (hosted by torchrun's agent on "
                    "node 0) no longer answers: node 0 was lost"
                ]
            return [
                f"{self.describe(self.store_host)} was lost: it hosts the process group's "
                "rendezvous store, which no longer answers"
            ]
        lost = [
            f"{self.describe(rank)} was lost: it stopped without reporting an error (killed, "
            "crashed or out of memory)"
            for rank in gone
            if rank not in reasons
        ]
        failed = [
            f"{self.describe(rank)} stopped after an error: {reasons[rank]}"
            for rank in gone
            if rank in reasons
        ]
        return lost + failed

    def explain(self, error: BaseException) -> str | None:
        """A message for ``error`` naming the ranks that stopped and how to resume; None when
        every other rank still beats."""
        stopped = self.stopped()
        if not stopped:
            return None
        return (
            f"{'; '.join(stopped)}. Re-run the same command with --ckpt_path last "
            "(Trainer.fit(ckpt_path='last')) to resume from the last checkpoint. "
            f"Rank {self.rank} stopped on: {error}"
        )

