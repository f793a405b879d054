"""A fit launched the way a cluster launches one, for ``test_launch.py``: every rank is a
separate ``python -m tests.distributed.launched SPEC`` process that finds its place from a
torchrun-style environment (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``/``GROUP_RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``; started by ``torchrun`` or by the test itself), and Lightning
starts the process group (gloo on loopback).

``SPEC`` is JSON: ``strategy`` (``"sharded"``: ``ShardedSequenceParallelStrategy``, ``"ddp"``:
``SequenceParallelStrategy``), ``sequence_parallel_size``, ``devices``, ``num_nodes``,
``max_steps``, ``timeout`` (of every collective, seconds), ``checkpoint_dir`` (a
``LastCheckpoint`` after every step), ``ckpt_path`` (``"last"`` to resume), ``signal``
(``{"rank": R, "step": S, "signum": N}``: rank ``R`` sends itself signal ``N``, SIGKILL by
default, in the middle of optimizer step ``S``, after its forward, before its backward, and
writes the time it did to ``out/signalled``), ``stop_on_signal`` (add
``longnet.training.trainer.StopOnSignal``, as the ``longnet`` command does: a stop by SIGTERM
exits with status 143) and ``out`` (a folder: each rank pickles
its result there as ``rank<R>.pkl``, and at exit ``rank<R>.exit``: whether the process
group was destroyed, and its group objects freed, before the interpreter's teardown). The tiny
model of ``strategy_cases`` trains in float64, as in ``sharded_cases``, so the result is
comparable with ``sharded_cases.single_device_run``.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from longnet.training import LastCheckpoint
from longnet.training.parallel.fsdp import ShardedSequenceParallelStrategy
from longnet.training.parallel.strategy import SequenceParallelStrategy
from longnet.training.trainer import StopOnSignal
from tests.distributed.sharded_cases import StepLosses, result, trainer_kwargs
from tests.distributed.strategy_cases import GLOBAL_BATCH, STEPS, TinyData, make_module


class SignalMidStep(L.Callback):
    """On ``rank``, send this process ``signum`` after the forward of optimizer step ``step``
    (its peers are then inside the step: the backward's ring exchanges and gradient
    reductions)."""

    def __init__(self, rank: int, step: int, out: str, signum: int = signal.SIGKILL) -> None:
        self.rank, self.step, self.signum, self.out = rank, step, signum, Path(out)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "signalled").write_text(str(time.time()))
            os.kill(os.getpid(), self.signum)


def fit(spec: dict[str, Any], groups: list[weakref.ref]) -> dict[str, Any]:
    """Run the fit of ``spec``; its result, and weak references to its process groups (the
    default one and the mesh's) appended to ``groups``."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    sp = spec["sequence_parallel_size"]
    options = dict(
        sequence_parallel_size=sp,
        process_group_backend="gloo",
        timeout=timedelta(seconds=spec.get("timeout", 300)),
    )
    if spec["strategy"] == "sharded":
        strategy = ShardedSequenceParallelStrategy(**options)
    else:
        strategy = SequenceParallelStrategy(**options)
    losses = StepLosses()
    callbacks: list[L.Callback] = [losses]
    kwargs = trainer_kwargs(spec.get("max_steps", STEPS))
    if spec.get("checkpoint_dir"):
        kwargs["enable_checkpointing"] = True
        callbacks.append(LastCheckpoint(dirpath=spec["checkpoint_dir"], every_n_train_steps=1))
    if spec.get("signal"):
        callbacks.append(SignalMidStep(**spec["signal"], out=spec["out"]))
    if spec.get("stop_on_signal"):
        callbacks.append(StopOnSignal())
    trainer = L.Trainer(
        devices=spec["devices"],
        num_nodes=spec.get("num_nodes", 1),
        strategy=strategy,
        callbacks=callbacks,
        **kwargs,
    )
    module = make_module()
    world = spec["devices"] * spec.get("num_nodes", 1)
    trainer.fit(module, datamodule=TinyData(GLOBAL_BATCH // (world // sp)), ckpt_path=spec.get(
        "ckpt_path"))
    out = result(trainer, module, losses)
    mesh = strategy.device_mesh
    groups.extend(weakref.ref(group) for group in
                  [torch.distributed.group.WORLD, *(mesh.get_group(d) for d in range(mesh.ndim))])
    out.update(
        global_rank=trainer.global_rank,
        node_rank=trainer.node_rank,
        local_rank=trainer.local_rank,
        mesh=tuple(strategy.device_mesh.mesh.shape),
        sp_ranks=torch.distributed.get_process_group_ranks(strategy.sequence_parallel_group),
    )
    return out


def record_process_group_at_exit(
    folder: Path, finished: dict[str, int], groups: list[weakref.ref]
) -> None:
    """At exit, after the strategy's exit hook (registered later, so run earlier), write
    ``rank<R>.exit``: whether the default process group was still up (``initialized``) or had
    been destroyed (``destroyed``), and ``, N groups alive`` when process group objects of the
    run (``groups``) were not freed (they would be in the interpreter's teardown); only for a
    rank whose fit finished (``finished["rank"]``)."""

    def record() -> None:
        if "rank" in finished:
            state = "initialized" if torch.distributed.is_initialized() else "destroyed"
            alive = sum(group() is not None for group in groups)
            if alive:
                state += f", {alive} groups alive"
            (folder / f"rank{finished['rank']}.exit").write_text(state)

    atexit.register(record)


def main() -> None:
    spec = json.loads(sys.argv[1])
    folder = Path(spec["out"])
    finished: dict[str, int] = {}
    groups: list[weakref.ref] = []
    record_process_group_at_exit(folder, finished, groups)
    out = fit(spec, groups)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{out['global_rank']}.pkl", "wb") as handle:
        pickle.dump(out, handle)
    finished["rank"] = out["global_rank"]


if __name__ == "__main__":
    main()
