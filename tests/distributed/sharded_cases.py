"""Workers for ``test_sharded.py``: the tiny LongNet LM of ``strategy_cases`` trained with
``ShardedSequenceParallelStrategy`` (FSDP2 over the flattened ``(dp, sp)`` mesh) on spawned
gloo process groups, and the same run on one process with Lightning's default strategy.

Everything runs in float64 (``torch.set_default_dtype``; the strategy keeps ``32-true``, which
converts nothing): three AdamW steps with gradient clipping (the clip is active: the gradient
norms exceed it), then validation. Each run reports the full parameters and AdamW moments
(gathered), the per-step training losses, validation loss and token count, and the bytes of
this rank's local shards of parameters, gradients and optimizer state.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from longnet.training import CausalLMModule, ExportPretrained
from longnet.training.parallel.fsdp import ShardedSequenceParallelStrategy
from tests.distributed.strategy_cases import (
    GLOBAL_BATCH,
    MODEL_OVERRIDES,
    STEPS,
    TinyData,
    make_module,
)

CLIP = 0.5


class StepLosses(L.Callback):
    """``train/loss`` (global batch, nats per token) after every optimizer step; just before
    each step (and before clipping), the gradients' total norm and the bytes of this rank's
    local gradient shards (Lightning drops the gradients afterwards)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.grad_norms: list[float] = []
        self.grad_bytes = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.model.parameters()]
        self.grad_norms.append(float(_full(torch.nn.utils.get_total_norm(grads))))
        self.grad_bytes = sum(_bytes(grad) for grad in grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def trainer_kwargs(max_steps: int = STEPS) -> dict[str, Any]:
    return dict(
        accelerator="cpu",
        precision="32-true",
        max_steps=max_steps,
        val_check_interval=STEPS,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a sharded DTensor: call on every rank, in order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def result(trainer: L.Trainer, module: CausalLMModule, losses: StepLosses) -> dict[str, Any]:
    """Parameters, AdamW moments and gradients' local bytes, losses, validation metrics."""
    optimizer = trainer.optimizers[0]
    params, moments = {}, {}
    local_bytes = {"params": 0, "grads": losses.grad_bytes, "optimizer": 0}
    for name, param in module.model.named_parameters():
        params[name] = _full(param.detach()).cpu().numpy().copy()
        state = optimizer.state[param]
        moments[name] = {
            key: _full(state[key]).cpu().numpy().copy() for key in ("exp_avg", "exp_avg_sq")
        }
        local_bytes["params"] += _bytes(param)
        # the 0-dim step counters are not sharded (one per parameter on every rank)
        local_bytes["optimizer"] += sum(
            _bytes(value) for value in state.values() if value.dim() > 0
        )
    metrics = trainer.callback_metrics
    return {
        "params": params,
        "moments": moments,
        "dtypes": sorted({str(p.dtype) for p in module.model.parameters()}),
        "local_bytes": local_bytes,
        "losses": dict(losses.losses),
        "grad_norms": list(losses.grad_norms),
        "val_loss": float(metrics["val/loss"]) if "val/loss" in metrics else None,
        "val_tokens": float(metrics["val/tokens"]) if "val/tokens" in metrics else None,
        "global_step": trainer.global_step,
    }


def single_device_run(loss_reduction: str = "token") -> dict[str, Any]:
    """The reference: one process, Lightning's default strategy, the whole global batch."""
    torch.set_num_threads(1)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        module = make_module(loss_reduction)
        losses = StepLosses()
        trainer = L.Trainer(devices=1, callbacks=[losses], **trainer_kwargs())
        trainer.fit(module, datamodule=TinyData(GLOBAL_BATCH))
        return result(trainer, module, losses)
    finally:
        torch.set_default_dtype(previous)


def sharded_run(
    rank: int,
    world_size: int,
    sequence_parallel_size: int,
    loss_reduction: str = "token",
    activation_checkpointing: bool = False,
    max_steps: int = STEPS,
    checkpoint_dir: str | None = None,
    resume_from: str | None = None,
    export_dir: str | None = None,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """One rank of a ``(world / sp, sp)`` mesh on the launcher's process group.

    ``checkpoint_dir``: save a distributed checkpoint after every step (``step=K.ckpt``
    folders). ``resume_from``: continue from that checkpoint (any earlier world size).
    ``export_dir``: ``ExportPretrained`` of the best checkpoint (``best/``) and of the final
    weights (``last/``). ``hidden_size``: a different model; the run reports the error it
    raises (``{"error": message}``).
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    torch.set_default_dtype(torch.float64)
    strategy = ShardedSequenceParallelStrategy(
        sequence_parallel_size=sequence_parallel_size,
        activation_checkpointing=activation_checkpointing,
        process_group_backend="gloo",
    )
    losses = StepLosses()
    kwargs = trainer_kwargs(max_steps)
    callbacks: list[L.Callback] = [losses]
    if checkpoint_dir is not None:
        kwargs["enable_checkpointing"] = True
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    if export_dir is not None:
        callbacks.append(ExportPretrained(dirpath=os.path.join(export_dir, "best")))
        callbacks.append(ExportPretrained(dirpath=os.path.join(export_dir, "last"), weights="last"))
    module = make_module(loss_reduction)
    if hidden_size is not None:
        module = CausalLMModule(
            model="longnet-tiny", overrides={**MODEL_OVERRIDES, "hidden_size": hidden_size}
        )
    trainer = L.Trainer(devices=world_size, strategy=strategy, callbacks=callbacks, **kwargs)
    data_parallel = world_size // sequence_parallel_size
    datamodule = TinyData(GLOBAL_BATCH // data_parallel)
    if hidden_size is not None:
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
        except ValueError as err:
            return {"error": str(err), "global_step": trainer.global_step}
        return {"error": None}
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    out = result(trainer, module, losses)
    out["mesh"] = tuple(strategy.device_mesh.mesh.shape)
    out["shard_mesh_size"] = strategy.shard_mesh.size()
    out["blocks_sharded"] = [type(block).__name__.startswith("FSDP") for block in module.blocks]
    return out


def sharded_runs(
    rank: int, world_size: int, device: torch.device, runs: tuple[dict[str, Any], ...]
) -> list[dict[str, Any]]:
    """:func:`sharded_run` for each keyword set, one after another in the same processes (one
    spawn, one process group, for several meshes)."""
    return [sharded_run(rank, world_size, **run) for run in runs]
