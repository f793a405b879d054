"""Run a function on ``world_size`` spawned processes in one process group (gloo on CPU, NCCL
with a GPU per rank), with a deadline; a worker that raises, hangs or dies fails the caller
(the distributed tests, ``lab/bench/ring.py``, ``lab/scripts/bench_load_balance.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def backend_and_device(rank: int, world_size: int) -> tuple[str, torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl", torch.device("cuda", rank)
    return "gloo", torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results) -> None:
    try:
        torch.set_num_threads(1)
        backend, device = backend_and_device(rank, world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        try:
            results.put((rank, "ok", fn(rank, world_size, device, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_workers(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """``fn(rank, world_size, device, *args)`` on every rank; returns the results by rank."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, args, results))
        for rank in range(world_size)
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for process in processes:
        process.start()
    collected: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            collected[rank] = (status, value)
    except Exception:
        missing = sorted(set(range(world_size)) - set(collected))
        raise TimeoutError(
            f"ranks {missing} of {world_size} gave no result within {timeout} s "
            f"(hang or crash); others: {collected}"
        ) from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    errors = {rank: value for rank, (status, value) in collected.items() if status == "error"}
    if errors:
        raise AssertionError(
            "\n".join(f"rank {rank}:\n{tb}" for rank, tb in sorted(errors.items()))
        )
    return [collected[rank][1] for rank in range(world_size)]
