"""``ShardedSequenceParallelStrategy``: FSDP2 over the whole ``(data, sequence)`` mesh, with
sequence parallelism inside attention (torchtitan's FSDP x context-parallel layout; see
docs/training.md for when to pick which strategy).

The layout is :class:`~longnet.training.SequenceParallelLayout`, as for
``SequenceParallelStrategy``; what differs is where the parameters, gradients and optimizer
state live: cut into ``world`` shards, one per rank of the flattened ``dp x sp`` mesh. Every
transformer block is one FSDP2 unit (its parameters all-gathered just before its forward and
backward, freed after) and the network is the root unit (embeddings, final norm, LM head).
Gradients are reduce-scattered and averaged over all ``world`` ranks, as DDP averages them, so
``CausalLMModule``'s loss scaling is unchanged.

The strategy applies ``fully_shard`` itself, in :meth:`setup`, on the module's ``network`` and
``blocks`` (a :class:`ShardedModule`), instead of Lightning's ``configure_model``: the same
``CausalLMModule`` runs on one device or under either strategy, and the whole parallel layout
(mesh, sharding, activation checkpointing, mixed precision) is configured in one place, the
trainer's strategy. A module that shards itself in ``configure_model`` is refused.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from longnet.training.checkpoint import is_sharded_checkpoint, sharded_tensor_shapes
from longnet.training.parallel.strategy import (
    MESH_DIMS,
    SequenceParallelLayout,
    SequenceParallelModule,
    check_module_protocol,
)

FLAT_MESH_DIM = "dp_sp"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class ShardedModule(SequenceParallelModule, Protocol):
    """What :class:`ShardedSequenceParallelStrategy` needs of the LightningModule it runs
    (:class:`~longnet.training.CausalLMModule` is one): a
    :class:`~longnet.training.SequenceParallelModule` that also names what to
    shard.

    Attributes:
        network: the ``nn.Module`` whose ``forward`` the module's steps call: the FSDP root
            unit (its parameters outside ``blocks``: embeddings, final norm, LM head).
        blocks: the network's repeated blocks: one FSDP unit (and, when asked, one
            activation-checkpointing unit) each.
    """

    @property
    def network(self) -> nn.Module: ...

    @property
    def blocks(self) -> nn.ModuleList: ...


def check_sharded_module(module: Any) -> ShardedModule:
    """``module`` if it is a :class:`ShardedModule`, else a ``TypeError`` naming what it
    lacks."""
    return check_module_protocol(
        module,
        ShardedModule,
        ("pattern", "pad_token_id", "network", "blocks"),
        "ShardedSequenceParallelStrategy",
    )


def mixed_precision_policy(
    param_dtype: str | None, reduce_dtype: str | None
) -> MixedPrecisionPolicy:
    """FSDP2's policy from dtype names (``"bfloat16"``, ``"float16"``, ``"float32"``; None
    keeps the parameters' dtype)."""
    dtypes = []
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and value not in DTYPES:
            raise ValueError(f"{name} must be one of {sorted(DTYPES)} or None, got {value!r}.")
        dtypes.append(None if value is None else DTYPES[value])
    return MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])


class ShardedSequenceParallelStrategy(SequenceParallelLayout, ModelParallelStrategy):
    """FSDP2 ``fully_shard`` over the flattened ``(dp, sp)`` mesh, sequence parallelism in
    the attention (:class:`~longnet.training.SequenceParallelLayout`).

    Select it from YAML (``configs/fsdp_sequence_parallel.yaml``)::

        trainer:
          devices: 4
          strategy:
            class_path: longnet.training.ShardedSequenceParallelStrategy
            init_args: {sequence_parallel_size: 2}

    Per rank, parameters, gradients and AdamW state take ``1 / world`` of one device's
    (FSDP pads each parameter's first dimension to a multiple of ``world``); one block's full
    parameters exist at a time while it runs. Checkpoints are distributed
    (``torch.distributed.checkpoint``): a folder every rank writes its shards to, which
    resumes on any world size (``longnet.training.checkpoint`` reads it on one process).

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; must divide the number of
            processes (``devices * num_nodes``). 1 is plain FSDP.
        load_balance: zigzag shards (as
            :class:`~longnet.training.SequenceParallelStrategy`); False keeps
            contiguous shards.
        activation_checkpointing: recompute every block's activations in backward
            (``torch.distributed._composable.checkpoint`` on each block, applied before
            ``fully_shard``; parameter names are unchanged).
        param_dtype, reduce_dtype: FSDP2 mixed precision: the dtype blocks compute in
            (parameters are all-gathered in it) and the dtype gradients are reduced in
            (``"bfloat16"``, ``"float16"``, ``"float32"``; None: the parameters' dtype).
            Sharded parameters and AdamW state stay in the parameters' dtype.
        reshard_after_forward: free each block's gathered parameters after its forward
            (gather again in backward: least memory); False keeps them until backward.
        save_distributed_checkpoint: True: every rank writes its shards to a checkpoint
            folder; False: rank 0 writes one full ``.ckpt`` file (gathered in its memory).
        process_group_backend: ``"gloo"`` / ``"nccl"``; None picks by device.
        timeout: timeout of every collective: a lost rank stops the others within it (at
            once when they exchange with it), with an error naming it.

    Raises:
        ValueError: when the ``Trainer`` is built, if ``sequence_parallel_size`` does not
            divide ``devices * num_nodes``. Lightning itself refuses precisions other than
            ``32-true``, ``bf16-mixed``, ``bf16-true`` and ``16-true`` with this strategy
            (float64 training: build the model in float64, e.g.
            ``torch.set_default_dtype(torch.float64)``, and keep ``32-true``).
    """

    def __init__(
        self,
        sequence_parallel_size: int = 1,
        load_balance: bool = True,
        activation_checkpointing: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self._init_layout(sequence_parallel_size, load_balance)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._device_mesh = None  # ModelParallelStrategy.__init__ resets it too
        self.activation_checkpointing = bool(activation_checkpointing)
        self.mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.shard_mesh: DeviceMesh | None = None
        self._sharded: nn.Module | None = None

    # ------------------------------------------------------------------ setup
    def connect(self, model: Any) -> None:
        """Take the LightningModule, which must be a :class:`ShardedModule`."""
        check_sharded_module(model)
        super().connect(model)

    def setup_environment(self) -> None:
        """Start the process group and build the ``(dp, sp)`` mesh (instead of Lightning's
        ``(data_parallel, tensor_parallel)`` one); runs on every fit/test. The layout is
        checked by :meth:`set_world_ranks`, which ``_setup_distributed`` calls first."""
        self._setup_distributed()
        self.lightning_module._device_mesh = self._start_layout()

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the module's network (:meth:`parallelize`), then what
        ``ModelParallelStrategy.setup`` does after the module's ``configure_model``: move to
        the device, convert for the precision, build the optimizers on the sharded
        parameters."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.parallelize(check_sharded_module(self.lightning_module))
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Check that a folder of shards holds this module's tensors with these shapes (from
        its index, before any tensor is read), then let Lightning load it (any world size)."""
        path = Path(self.broadcast(checkpoint_path))
        if is_sharded_checkpoint(path):
            check_checkpoint_fits(path, get_model_state_dict(self.model))
        return super().load_checkpoint(path, weights_only=weights_only)

    def parallelize(self, module: ShardedModule) -> None:
        """``fully_shard`` every block, then the network, over :attr:`shard_mesh`, the
        ``(dp, sp)`` mesh flattened to one dimension of ``world`` ranks (with activation
        checkpointing on each block first when asked). Runs once per strategy: a later
        ``fit``/``validate``/``test`` of the same trainer finds the network sharded; a network
        sharded elsewhere (another trainer, ``configure_model``) is refused."""
        network = module.network
        if network is self._sharded:
            return
        if any(isinstance(sub, FSDPModule) for sub in network.modules()):
            raise TypeError(
                f"{type(module).__name__}'s network is already sharded (fully_shard applied by "
                "another trainer or in configure_model); ShardedSequenceParallelStrategy "
                "applies fully_shard itself: give it a freshly built module."
            )
        self.shard_mesh = self.device_mesh[MESH_DIMS]._flatten(FLAT_MESH_DIM)
        for block in module.blocks:
            if self.activation_checkpointing:
                checkpoint(block)
            fully_shard(
                block,
                mesh=self.shard_mesh,
                mp_policy=self.mp_policy,
                reshard_after_forward=self.reshard_after_forward,
            )
        fully_shard(
            network,
            mesh=self.shard_mesh,
            mp_policy=self.mp_policy,
            reshard_after_forward=self.reshard_after_forward,
        )
        self._sharded = network


def check_checkpoint_fits(path: Path, state: dict[str, Any]) -> None:
    """A ``ValueError`` naming every missing, unexpected and mis-shaped tensor when the folder
    of shards at ``path`` does not hold ``state``'s tensors (full shapes) exactly."""
    saved = sharded_tensor_shapes(path)
    expected = {name: tuple(value.shape) for name, value in state.items()}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [
        f"{name}: checkpoint {saved[name]}, model {shape}"
        for name, shape in sorted(expected.items())
        if name in saved and saved[name] != shape
    ]
    if missing or unexpected or shapes:
        problems = [
            f"{label} ({len(names)}): {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
            for label, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("mis-shaped", shapes),
            )
            if names
        ]
        raise ValueError(
            f"the checkpoint {path} was written by a different model: "
            f"{'; '.join(problems)}. Resume with the model settings of the run that wrote it."
        )
