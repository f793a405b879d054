"""Fits launched as a cluster launches them (``launched.py``: one process per rank, placed by
a torchrun-style environment, gloo on loopback):

- a rank killed with SIGKILL in the middle of a step: the survivors stop, well within the
  collective timeout, with an error naming the lost rank (its pid) and how to resume, also
  when the lost rank is rank 0, whose process hosts the rendezvous store; re-running the same
  command with ``ckpt_path="last"`` continues to the parameters of an uninterrupted run;
- SIGTERM in the middle of a ring step stops every rank without waiting for the timeout;
  with ``StopOnSignal`` (the ``longnet`` command's), SIGTERM to one rank stops every rank at
  the end of the step with a checkpoint and exit status 143;
- 2 nodes x 2 processes (two ``torchrun`` agents, ``num_nodes=2``) train like one device,
  hence like 1 node x 4 processes (``test_sharded.py``), with the ring spanning both nodes.

Every run is float64 and compared with ``sharded_cases.single_device_run`` (three AdamW steps
with active clipping).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.sharded_cases import single_device_run
from tests.distributed.strategy_cases import STEPS

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 900  # seconds for a whole group of processes: two cores, whatever else runs
COLLECTIVE_TIMEOUT = 120  # the strategies' timeout in these runs: the survivors stop well before


@pytest.fixture(scope="module")
def reference():
    return single_device_run("token")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**values: object) -> dict[str, str]:
    env = {**os.environ, **{key: str(value) for key, value in values.items()}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT
        )


def launch_ranks(spec: dict, world: int, logs: Path) -> list[subprocess.Popen]:
    """One process per rank on one node, as torchrun's workers see it (without an agent)."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    return [
        start(
            [sys.executable, "-m", "tests.distributed.launched", json.dumps(spec)],
            environment(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE=world,
                NODE_RANK=0,
                LOCAL_RANK=rank,
            ),
            logs / f"rank{rank}.log",
        )
        for rank in range(world)
    ]


def wait_all(processes: list[subprocess.Popen], deadline: float = DEADLINE) -> list[float]:
    """Wait for every process; returns when each exited (``time.time()``). A process still
    running at the deadline is killed and fails the test (a hang)."""
    ended: dict[int, float] = {}
    stop = time.time() + deadline
    while len(ended) < len(processes):
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.time()
        if time.time() > stop:
            for process in processes:
                process.kill()
            pytest.fail(f"processes {sorted(set(range(len(processes))) - set(ended))} hung")
        time.sleep(0.2)
    return [ended[index] for index in range(len(processes))]


def results(folder: Path, world: int) -> list[dict]:
    runs = []
    for rank in range(world):
        with open(folder / f"rank{rank}.pkl", "rb") as handle:
            runs.append(pickle.load(handle))
    return runs


def assert_reference_parameters(runs: list[dict], reference: dict, where: str) -> None:
    for run in runs:
        assert run["global_step"] == STEPS, where
        for name, value in reference["params"].items():
            np.testing.assert_allclose(
                run["params"][name], value, rtol=0, atol=1e-6, err_msg=f"{where}: {name}"
            )


@pytest.mark.parametrize(
    ("strategy", "victim", "names"),
    [
        # the ring and FSDP's reductions: rank 1 dies in step 3's backward
        ("sharded", 1, "was lost: it stopped without reporting an error"),
        # DDP; rank 0 hosts the store the survivors' heartbeats go to (slow: CI runs the
        # sharded case, which loses a rank inside the ring)
        pytest.param("ddp", 0, "was lost: it hosts the process group's rendezvous store",
                     marks=pytest.mark.slow),
    ],
)
def test_a_lost_rank_is_named_and_the_same_command_resumes(
    tmp_path, reference, strategy, victim, names
):
    spec = dict(
        strategy=strategy,
        sequence_parallel_size=2,
        devices=2,
        timeout=COLLECTIVE_TIMEOUT,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        out=str(tmp_path / "killed"),
    )
    processes = launch_ranks(
        {**spec, "signal": {"rank": victim, "step": 3}}, 2, tmp_path / "logs"
    )
    ended = wait_all(processes)
    survivor = 1 - victim
    log = (tmp_path / "logs" / f"rank{survivor}.log").read_text()
    assert processes[victim].returncode == -9, log
    assert processes[survivor].returncode not in (0, None), log
    # after the kill: the heartbeat silence (3 s), Lightning's teardown, the interpreter's exit
    assert ended[survivor] - ended[victim] < COLLECTIVE_TIMEOUT / 2, log
    pid = processes[victim].pid
    assert f"rank {victim} (pid {pid} on {socket.gethostname()}) {names}" in log, log
    assert "Re-run the same command with --ckpt_path last" in log, log
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()

    # the same command, resumed: step 3 again, from the step-2 checkpoint
    processes = launch_ranks(
        {**spec, "ckpt_path": "last", "out": str(tmp_path / "resumed")}, 2, tmp_path / "logs2"
    )
    wait_all(processes)
    assert [process.returncode for process in processes] == [0, 0], (
        (tmp_path / "logs2" / "rank0.log").read_text()
    )
    runs = results(tmp_path / "resumed", 2)
    for run in runs:
        assert sorted(run["losses"]) == [3]
    # a finished run destroys its gloo groups, and frees their objects, before the
    # interpreter's teardown, which could otherwise abort the process after the run (SIGABRT,
    # seen intermittently here)
    for rank in range(2):
        assert (tmp_path / "resumed" / f"rank{rank}.exit").read_text() == "destroyed"
    assert_reference_parameters(runs, reference, f"{strategy}, resumed after rank {victim}")


def _signal_one_rank(tmp_path, **spec) -> tuple[list, float]:
    """Launch 2 sequence-parallel ranks, one of which signals itself as ``spec["signal"]``
    says; the processes and the seconds from the signal to the last rank's exit."""
    spec = dict(sequence_parallel_size=2, devices=2, timeout=COLLECTIVE_TIMEOUT,
                out=str(tmp_path / "out"), **spec)
    processes = launch_ranks(spec, 2, tmp_path / "logs")
    ended = wait_all(processes)
    signalled = float((tmp_path / "out" / "signalled").read_text())
    return processes, max(ended) - signalled


def test_sigterm_in_the_middle_of_a_ring_step_stops_every_rank(tmp_path):
    """SIGTERM to rank 0 after its forward: its handler must not start a collective (Lightning's
    broadcasts from rank 0), or rank 0 waits in it for rank 1 while rank 1 waits in the ring's
    backward exchange for rank 0, until the collective timeout (measured without
    ``note_sigterm_without_collectives``: both stopped 127 s after the signal, at the 120 s
    timeout). Rank 0 finishes the step and stops (Lightning's SIGTERMException, exit 0); rank 1
    stops at its next collective, naming rank 0."""
    processes, stopped_after = _signal_one_rank(
        tmp_path, strategy="ddp", signal={"rank": 0, "step": 2, "signum": int(signal.SIGTERM)}
    )
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert stopped_after < COLLECTIVE_TIMEOUT / 2, log
    assert processes[1].returncode != 0, log
    assert f"rank 0 (pid {processes[0].pid} on {socket.gethostname()}) was lost" in log, log


@pytest.mark.parametrize(
    ("strategy", "signalled"),
    [
        # CI signals each rank once, under each strategy once; the other pairs are slow
        pytest.param("ddp", 0, id="ddp-rank0"),
        pytest.param("sharded", 1, id="sharded-rank1"),
        pytest.param("ddp", 1, id="ddp-rank1", marks=pytest.mark.slow),
        pytest.param("sharded", 0, id="sharded-rank0", marks=pytest.mark.slow),
    ],
)
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint(tmp_path, strategy, signalled):
    """SIGTERM to one rank alone, each in turn, in the middle of a ring step (Lightning
    broadcasts rank 0's flag only: a signalled rank 1 would stop alone and rank 0 wait for
    it): with ``StopOnSignal`` both ranks agree at the end of the step, both stop there with
    ``last.ckpt`` of that step and exit with status 143, well before the collective
    timeout."""
    processes, stopped_after = _signal_one_rank(
        tmp_path, strategy=strategy, checkpoint_dir=str(tmp_path / "checkpoints"),
        stop_on_signal=True,
        signal={"rank": signalled, "step": 2, "signum": int(signal.SIGTERM)},
    )
    logs = [(tmp_path / "logs" / f"rank{rank}.log").read_text() for rank in range(2)]
    assert [process.returncode for process in processes] == [143, 143], logs
    assert stopped_after < COLLECTIVE_TIMEOUT / 2, logs
    for rank, log in enumerate(logs):
        by = "" if rank == signalled else " (received by another rank)"
        assert f"longnet: [rank {rank}] stopped by SIGTERM{by} after step 2 of {STEPS}; " \
               "saved" in log, log
        assert "was lost" not in log, log
    assert "longnet: received SIGTERM: stopping at the end of this step" in logs[signalled]
    last = tmp_path / "checkpoints" / "last.ckpt"
    meta = last / "meta.pt" if last.is_dir() else last
    assert torch.load(meta, map_location="cpu", weights_only=True)["global_step"] == 2


def test_two_nodes_of_two_processes_train_like_one_device(tmp_path, reference):
    """``torchrun --nnodes 2 --nproc-per-node 2`` twice (static rendezvous on loopback, the
    store in node 0's agent), ``num_nodes=2``: one sequence-parallel group of 4 spanning both
    nodes (the 1 x 4 mesh of ``test_sharded.py``), FSDP over all 4."""
    port = free_port()
    spec = dict(
        strategy="sharded",
        sequence_parallel_size=4,
        devices=2,
        num_nodes=2,
        out=str(tmp_path / "out"),
    )
    agents = [
        start(
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--max-restarts", "0",
                "-m", "tests.distributed.launched", json.dumps(spec),
            ],
            environment(),
            tmp_path / f"node{node}.log",
        )
        for node in range(2)
    ]
    wait_all(agents)
    logs = "\n".join((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert [agent.returncode for agent in agents] == [0, 0], logs
    runs = results(tmp_path / "out", 4)
    for rank, run in enumerate(runs):
        assert (run["global_rank"], run["node_rank"], run["local_rank"]) == (
            rank, rank // 2, rank % 2
        )
        assert run["mesh"] == (1, 4)
        assert run["sp_ranks"] == [0, 1, 2, 3]
        assert run["val_tokens"] == reference["val_tokens"]
        assert run["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-9)
    assert_reference_parameters(runs, reference, "2 nodes x 2 processes")
