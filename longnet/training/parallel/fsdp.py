"""``ShardedSequenceParallelStrategy``: FSDP2 over the flattened ``(dp, sp)`` mesh, sequence
parallelism inside attention (torchtitan's FSDP x context-parallel layout; docs/training.md).

Each block is one FSDP2 unit, the network the root unit; gradients are averaged over all
ranks as under DDP, so ``CausalLMModule``'s loss scaling is unchanged. The strategy applies
``fully_shard`` itself (not ``configure_model``), so one module runs under any strategy.
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
    """A :class:`~longnet.training.SequenceParallelModule` that names what to
    shard (:class:`~longnet.training.CausalLMModule` is one).

    Attributes:
        network: the module the steps call: the FSDP root unit (embeddings, norm, LM head).
        blocks: the network's blocks: one FSDP (and activation-checkpointing) unit each.
    """

    @property
    def network(self) -> nn.Module: ...

    @property
    def blocks(self) -> nn.ModuleList: ...


def check_sharded_module(module: Any) -> ShardedModule:
    """``module`` if it is a :class:`ShardedModule`, else a ``TypeError``."""
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
    the attention; ``class_path: longnet.training.ShardedSequenceParallelStrategy``
    (``configs/fsdp_sequence_parallel.yaml``). Checkpoints are folders of shards that resume
    on any world size (``longnet.training.checkpoint`` reads them on one process).

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; must divide
            ``devices * num_nodes``. 1 is plain FSDP.
        load_balance: zigzag shards; False keeps contiguous shards.
        activation_checkpointing: recompute every block's activations in backward
            (``checkpoint`` on each block before ``fully_shard``; names unchanged).
        param_dtype, reduce_dtype: FSDP2 mixed precision: the dtype blocks compute in and the
            dtype gradients are reduced in (``"bfloat16"``, ``"float16"``, ``"float32"``;
            None: the parameters' dtype, which sharded parameters and AdamW state keep).
        reshard_after_forward: free each block's gathered parameters after its forward;
            False keeps them until backward.
        save_distributed_checkpoint: True: every rank writes its shards to a folder; False:
            rank 0 writes one full ``.ckpt`` file.
        process_group_backend: ``"gloo"`` / ``"nccl"``; None picks by device.
        timeout: timeout of every collective (a lost rank stops the others within it).

    Raises:
        ValueError: when the ``Trainer`` is built, if ``sequence_parallel_size`` does not
            divide ``devices * num_nodes``. (Lightning allows only ``32-true``,
            ``bf16-mixed``, ``bf16-true`` and ``16-true``; float64: build the model in
            float64 and keep ``32-true``.)
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
        """Start the process group and build the ``(dp, sp)`` mesh (not Lightning's
        ``(data_parallel, tensor_parallel)`` one); runs on every fit/test."""
        self._setup_distributed()
        self.lightning_module._device_mesh = self._start_layout()

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the network (:meth:`parallelize`), then ``ModelParallelStrategy.setup``'s
        steps after ``configure_model``: device, precision, optimizers."""
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
        """Check a folder of shards against this module's tensor shapes (from its index),
        then let Lightning load it."""
        path = Path(self.broadcast(checkpoint_path))
        if is_sharded_checkpoint(path):
            check_checkpoint_fits(path, get_model_state_dict(self.model))
        return super().load_checkpoint(path, weights_only=weights_only)

    def parallelize(self, module: ShardedModule) -> None:
        """``fully_shard`` every block, then the network, over :attr:`shard_mesh` (the mesh
        flattened). Once per strategy; a network sharded elsewhere is refused."""
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
    """A ``ValueError`` naming every missing, unexpected and mis-shaped tensor unless the
    folder of shards ``path`` holds exactly ``state``'s tensors (full shapes)."""
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
