"""RankWatch tells the ranks that stopped from the live ones by their heartbeats in a store
(in-process here: two watches over one store; ``tests/distributed/test_launch.py`` kills real
processes), and Lightning's SIGTERM handler starts no collective under the strategies."""

from __future__ import annotations

import signal
import socket
from datetime import timedelta

import lightning as L
import torch.distributed as dist

from longnet.distributed.watch import RankWatch
from longnet.training.parallel.strategy import note_sigterm_without_collectives

FAST = dict(heartbeat_seconds=0.05, silence_seconds=0.5)
HOST = socket.gethostname()


def watches(store: dist.Store, world: int = 3) -> list[RankWatch]:
    return [RankWatch(store, rank, world, store_host=0, **FAST) for rank in range(world)]


def test_live_ranks_are_not_named():
    ranks = watches(dist.HashStore())
    try:
        assert ranks[0].stopped() == []
        assert ranks[0].explain(RuntimeError("mine")) is None
    finally:
        for watch in ranks:
            watch.stop()


def test_a_silent_rank_is_lost_and_a_marked_one_stopped_after_its_error():
    store = dist.HashStore()
    first = watches(store)
    for watch in first:
        watch.stop()  # a second run over the same store: fresh keys, nobody marked yet
    ranks = watches(store)
    try:
        ranks[2].mark_failed(ValueError("bad batch\nsecond line"))
        ranks[1].stop()
        ranks[2].stop()
        message = ranks[0].explain(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
        pid = ranks[0].who[0].split()[1]  # one process plays every rank here
        assert message.startswith(
            f"rank 1 (pid {pid} on {HOST}) was lost: it stopped without reporting an error"
        ), message
        assert f"rank 2 (pid {pid} on {HOST}) stopped after an error: ValueError: bad batch." in (
            message
        )
        assert "--ckpt_path last" in message
        assert message.endswith("Rank 0 stopped on: Connection closed by peer [127.0.0.1]:4242")
    finally:
        ranks[0].stop()


def test_a_store_that_no_longer_answers_names_its_host():
    port_probe = socket.socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    host = RankWatch(server, 0, 2, store_host=0, **FAST)
    survivor = RankWatch(client, 1, 2, store_host=0, **FAST)
    agent = RankWatch(client, 1, 2, store_host=None, **FAST)
    try:
        host.stop()
        del host, server  # the store's process is gone
        assert survivor.stopped() == [
            f"{survivor.describe(0)} was lost: it hosts the process group's rendezvous store, "
            "which no longer answers"
        ]
        assert survivor.describe(0).startswith("rank 0 (pid ")
        assert "torchrun's agent on node 0" in agent.stopped()[0]
    finally:
        survivor.stop()
        agent.stop()


def test_sigterm_handler_starts_no_collective(monkeypatch):
    """Lightning's own handler broadcasts when a process group of more than one rank is up;
    after ``note_sigterm_without_collectives`` it only notes the signal."""
    broadcasts = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for quiet in (False, True):
            trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
            if quiet:
                note_sigterm_without_collectives(trainer)
            trainer._signal_connector.register_signal_handlers()
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            assert trainer.received_sigterm
            assert len(broadcasts) == (0 if quiet else 1), quiet
            broadcasts.clear()
            trainer._signal_connector.teardown()
    finally:
        signal.signal(signal.SIGTERM, previous)

