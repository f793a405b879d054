"""``SequenceParallelStrategy``: data parallelism over sequence-parallel groups (docs/training.md).

``world_size = dp * sp`` processes form a ``(dp, sp)`` device mesh: ranks
``d * sp .. d * sp + sp - 1`` are sequence-parallel group ``d`` (contiguous, so on one node
they share the fastest links). Every rank of a group reads the same samples (the sampler sees
``dp`` replicas), cuts each sequence into its contiguous shard (padding the length to one
the model's dilated pattern can run on), and runs the model with the group handed to the
attention. Gradients are all-reduced (averaged) over all ``dp * sp`` ranks by DDP; the
LightningModule scales its loss by ``world_size / global scored tokens`` so the update equals
single-device training on the same global batch (see ``CausalLMModule``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longnet.training.sharding import shard_batch

MESH_DIMS = ("dp", "sp")


class SequenceParallelStrategy(DDPStrategy):
    """DDP over a ``(data-parallel, sequence-parallel)`` mesh.

    Select it from YAML::

        trainer:
          devices: 4
          strategy:
            class_path: longnet.training.SequenceParallelStrategy
            init_args: {sequence_parallel_size: 2}

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; must divide the number of
            processes (``devices * num_nodes``). 1 is plain DDP.
        process_group_backend: ``"gloo"`` / ``"nccl"``; None picks by device.
        start_method: how Lightning starts the processes (see ``DDPStrategy``).
        **kwargs: passed to ``DDPStrategy`` / ``DistributedDataParallel``.

    Attributes (after setup):
        device_mesh: the ``(dp, sp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`.
        sequence_parallel_group: the process group of this rank's sequence shards (None when
            ``sequence_parallel_size == 1``).
    """

    def __init__(
        self,
        sequence_parallel_size: int = 1,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if (isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int)
                or sequence_parallel_size < 1):
            raise ValueError(
                f"sequence_parallel_size must be a positive integer, got "
                f"{sequence_parallel_size!r}."
            )
        super().__init__(
            process_group_backend=process_group_backend,
            start_method=start_method,
            **kwargs,
        )
        self.sequence_parallel_size = sequence_parallel_size
        self.device_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ layout
    @property
    def data_parallel_size(self) -> int:
        return self.num_nodes * self.num_processes // self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.sequence_parallel_size

    @property
    def sequence_parallel_rank(self) -> int:
        return self.global_rank % self.sequence_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas only: all ranks of a sequence-parallel group read the same
        samples."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def sequence_parallel_group(self) -> dist.ProcessGroup | None:
        if self.sequence_parallel_size == 1:
            return None
        if self.device_mesh is None:
            raise RuntimeError(
                "SequenceParallelStrategy: the device mesh is not built yet (setup_environment "
                "has not run)."
            )
        return self.device_mesh.get_group("sp")

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        """Start the process group (DDP) and build the mesh once; runs on every fit/test."""
        self._check_layout()
        super().setup_environment()
        if self.device_mesh is None:
            device_type = "cuda" if self.root_device.type == "cuda" else "cpu"
            self.device_mesh = init_device_mesh(
                device_type,
                (self.data_parallel_size, self.sequence_parallel_size),
                mesh_dim_names=MESH_DIMS,
            )

    def _check_layout(self) -> None:
        world = self.num_nodes * self.num_processes
        if world % self.sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide the "
                f"{world} processes (devices x num_nodes = {self.num_processes} x "
                f"{self.num_nodes}); choose a divisor of {world} or change devices."
            )

    # ------------------------------------------------------------------ batches
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Move the batch, then cut every sequence to this rank's shard (global positions)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sequence_parallel_size == 1:
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(
                "SequenceParallelStrategy shards dict batches with 'input_ids' (and "
                f"'labels'); got {type(batch).__name__}."
            )
        module = self.lightning_module
        return shard_batch(
            batch,
            self.sequence_parallel_rank,
            self.sequence_parallel_size,
            pattern=getattr(module, "pattern", None),
            pad_token_id=getattr(module, "pad_token_id", 0),
        )
