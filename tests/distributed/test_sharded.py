"""ShardedSequenceParallelStrategy (FSDP2 over the flattened data x sequence mesh) trains
exactly like one device, in float64: 4 gloo processes as (2 x 2) and (1 x 4) meshes, three
AdamW steps with active gradient clipping, token-mean and sample-mean losses, activation
checkpointing on one mesh; each rank holds 1/world of the parameters, gradients and AdamW
state; distributed checkpoints resume on the same layout and on 4 -> 2 -> 1 processes, refuse
a different model, and turn into save_pretrained folders (ExportPretrained, export_pretrained).

All meshes of one world size run in one spawned process group (``sharded_cases.sharded_runs``):
every spawn pays the torch import."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lab.memory.state import ParameterShapes, StateDtypes, model_config, state_memory
from lab.workers import run_workers
from longnet.modeling import LongNetLM
from longnet.training.checkpoint import export_pretrained
from tests.distributed.sharded_cases import CLIP, STEPS, sharded_runs, single_device_run
from tests.distributed.strategy_cases import MODEL_OVERRIDES

pytestmark = pytest.mark.distributed

# generous: four processes share two cores, under whatever else the machine runs
DEADLINE = 1200

MESHES = {  # name: (dp, sp, loss reduction, activation checkpointing)
    "2x2": (2, 2, "token", True),
    "1x4": (1, 4, "token", False),
    "2x2-sample": (2, 2, "sample", False),
}


@pytest.fixture(scope="module")
def references():
    return {reduction: single_device_run(reduction) for reduction in ("token", "sample")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded-checkpoints")


@pytest.fixture(scope="module")
def four_processes(checkpoints):
    """Every 4-process run, by name: the meshes (the 2 x 2 token run also writes a checkpoint
    after every step), then a 2 x 2 run resumed from its step-2 checkpoint."""
    runs = [
        dict(
            sequence_parallel_size=sp,
            loss_reduction=reduction,
            activation_checkpointing=ac,
            checkpoint_dir=str(checkpoints / "world4") if name == "2x2" else None,
            export_dir=str(checkpoints / "export") if name == "2x2" else None,
        )
        for name, (_, sp, reduction, ac) in MESHES.items()
    ]
    runs.append(
        dict(sequence_parallel_size=2, resume_from=str(checkpoints / "world4" / "step=2.ckpt"))
    )
    per_rank = run_workers(sharded_runs, 4, tuple(runs), timeout=DEADLINE)
    names = [*MESHES, "resumed-2x2"]
    return {name: [rank_runs[index] for rank_runs in per_rank] for index, name in enumerate(names)}


def assert_same_training(run: dict, reference: dict, where: str, steps=range(1, STEPS + 1)):
    """Parameters and AdamW moments to 1e-6 (float64: in practice ~1e-15), per-step losses."""
    assert run["global_step"] == STEPS, where
    assert run["dtypes"] == ["torch.float64"], where
    for name, value in reference["params"].items():
        np.testing.assert_allclose(
            run["params"][name], value, rtol=0, atol=1e-6, err_msg=f"{where}: {name}"
        )
        for moment, expected in reference["moments"][name].items():
            np.testing.assert_allclose(
                run["moments"][name][moment],
                expected,
                rtol=0,
                atol=1e-6,
                err_msg=f"{where}: {name} {moment}",
            )
    for step in steps:
        assert run["losses"][step] == pytest.approx(reference["losses"][step], rel=1e-9), (
            f"{where}: loss of step {step}"
        )


def test_meshes_equal_single_device_training(references, four_processes):
    for name, (dp, sp, reduction, _) in MESHES.items():
        reference = references[reduction]
        # the clip is active: every step's gradient norm is above it
        assert min(reference["grad_norms"]) > CLIP
        for rank, run in enumerate(four_processes[name]):
            where = f"mesh {name}, {reduction} loss, rank {rank}"
            assert run["mesh"] == (dp, sp), where
            assert run["shard_mesh_size"] == 4, where
            assert all(run["blocks_sharded"]), where
            np.testing.assert_allclose(
                run["grad_norms"], reference["grad_norms"], rtol=1e-9, err_msg=where
            )
            assert_same_training(run, reference, where)
            assert run["val_tokens"] == reference["val_tokens"], where
            assert run["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-9), where


def test_each_rank_holds_a_quarter_of_params_grads_and_optimizer_state(references, four_processes):
    """Local shards of every rank add up to one device's tensors exactly; none is larger than
    ``1 / world`` of them with every parameter's first dimension padded to a multiple of
    ``world`` (what FSDP2 allocates). ``lab.memory.state`` (``plan_context.py``) plans
    that padded bound from the config alone, within 15 % of the largest rank's measured
    shards, and one device's tensors as what a DDP rank holds (its buckets aside)."""
    reference = references["token"]
    world = 4
    total = reference["local_bytes"]
    padded = 0
    for value in reference["params"].values():
        rows = value.shape[0]
        padded += math.ceil(rows / world) * world * (value.size // rows) * value.itemsize
    bound = {"params": padded // world, "grads": padded // world, "optimizer": 2 * padded // world}
    shapes = ParameterShapes.of_config(model_config("longnet-tiny", MODEL_OVERRIDES))
    float64 = StateDtypes.uniform(torch.float64)
    ddp = state_memory(shapes, "ddp", world, 1, float64)
    assert total == {
        "params": ddp.parameter_bytes,
        "grads": ddp.gradient_bytes,
        "optimizer": ddp.optimizer_bytes,
    }
    for name in ("2x2", "1x4"):
        per_rank = [run["local_bytes"] for run in four_processes[name]]
        fsdp = state_memory(shapes, "fsdp", world, MESHES[name][1], float64)
        planned = {
            "params": fsdp.parameter_bytes,
            "grads": fsdp.gradient_bytes,
            "optimizer": fsdp.optimizer_bytes,
        }
        for kind in ("params", "grads", "optimizer"):
            measured = max(rank[kind] for rank in per_rank)
            print(f"{name} {kind}: planned {planned[kind]} B, measured max {measured} B")
            assert sum(rank[kind] for rank in per_rank) == total[kind], (name, kind)
            assert measured <= bound[kind], (name, kind)
            assert measured >= total[kind] // world, (name, kind)
            assert planned[kind] == bound[kind], (name, kind)
            assert abs(planned[kind] - measured) <= 0.15 * measured, (name, kind, planned)


def test_resume_on_the_same_layout(references, four_processes):
    for rank, run in enumerate(four_processes["resumed-2x2"]):
        where = f"2x2 resumed at step 2, rank {rank}"
        assert sorted(run["losses"]) == [3], where
        assert_same_training(run, references["token"], where, steps=[3])
        assert run["val_loss"] == pytest.approx(references["token"]["val_loss"], rel=1e-9)


def test_resume_on_4_then_2_then_1_processes(references, four_processes, checkpoints):
    """Step 1 on 4 processes (2 x 2), step 2 on 2 (1 x 2) from its checkpoint, step 3 on one
    process from that one: parameters, AdamW moments and the losses of the resumed steps
    equal the uninterrupted single-device run."""
    two = run_workers(
        sharded_runs,
        2,
        (
            dict(
                sequence_parallel_size=2,
                max_steps=2,
                checkpoint_dir=str(checkpoints / "world2"),
                resume_from=str(checkpoints / "world4" / "step=1.ckpt"),
            ),
            dict(
                sequence_parallel_size=2,
                hidden_size=48,
                resume_from=str(checkpoints / "world4" / "step=1.ckpt"),
            ),
        ),
        timeout=DEADLINE,
    )
    reference = references["token"]
    for rank, (run, wrong_model) in enumerate(two):
        assert sorted(run["losses"]) == [2], rank
        assert run["losses"][2] == pytest.approx(reference["losses"][2], rel=1e-9), rank
        # a checkpoint of another model: a clear error before any step
        assert wrong_model["global_step"] == 0, rank
        message = wrong_model["error"]
        assert "step=1.ckpt was written by a different model" in message, message
        assert "model.model.embed_tokens.weight: checkpoint (256, 32), model (256, 48)" in message
    ((one,),) = run_workers(
        sharded_runs,
        1,
        (dict(sequence_parallel_size=1, resume_from=str(checkpoints / "world2" / "step=2.ckpt")),),
        timeout=DEADLINE,
    )
    assert sorted(one["losses"]) == [3]
    assert_same_training(
        one, reference, "1 process resumed at step 2 (from 2 processes)", steps=[3]
    )


def test_sharded_checkpoints_export_to_pretrained_folders(references, four_processes, checkpoints):
    """ExportPretrained at the end of a sharded fit (the best checkpoint's folder, and the final
    weights gathered from the shards) and export_pretrained of a folder on one process give
    the single-device parameters, read back in float64: ExportPretrained's folders hold the
    float64 parameters as trained, export_pretrained's float32 ones (it loads a checkpoint in
    float32), within 2**-24 x |weight| < 1e-7 of them."""
    expected = references["token"]["params"]
    folders = [checkpoints / "export" / "best", checkpoints / "export" / "last"]
    folders.append(
        export_pretrained(checkpoints / "world4" / "step=3.ckpt", checkpoints / "exported")
    )
    for folder in folders:
        model = LongNetLM.from_pretrained(folder, dtype=torch.float64)
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(expected), folder
        for name, value in expected.items():
            np.testing.assert_allclose(
                params[name].detach().numpy(),
                value,
                rtol=0,
                atol=1e-6,
                err_msg=f"{folder}: {name}",
            )
