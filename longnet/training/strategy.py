"""``SequenceParallelStrategy``: data parallelism across sequence-parallel groups.

See docs/training.md (``SequenceParallelStrategy``) for the training side and
docs/architecture.md §4 for the attention across a group.

``world_size = dp * sp`` processes form a ``(dp, sp)`` device mesh: ranks
``d * sp .. d * sp + sp - 1`` are sequence-parallel group ``d`` (contiguous, so on one node
they share the fastest links). Every rank of a group reads the same samples (the sampler sees
``dp`` replicas), cuts each sequence into its contiguous shard (padding the length to one
the model's dilated pattern can run on), and runs the model with the group handed to the
attention. Gradients are all-reduced (averaged) over all ``dp * sp`` ranks by DDP; the
LightningModule scales its loss by ``world_size / global scored tokens`` so the update equals
single-device training on the same global batch (see ``CausalLMModule``).

The contract between the strategy and the LightningModule, both ways:

- the module is a :class:`SequenceParallelModule`: it exposes ``pattern`` and
  ``pad_token_id``, which the strategy needs to cut a batch into shards (checked when the
  strategy is given the module: another module raises ``TypeError``);
- the strategy exposes ``sequence_parallel_group`` (and ``sequence_parallel_rank``,
  ``data_parallel_rank``), which ``CausalLMModule`` hands to the attention: the module reads
  them from a :class:`SequenceParallelStrategy` only; under any other Lightning strategy it
  runs without a group (every rank holds whole sequences).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longnet.attention import DilatedPattern
from longnet.training.sharding import shard_batch
from longnet.validation import UsageError, check_positive_int

MESH_DIMS = ("dp", "sp")


@runtime_checkable
class SequenceParallelModule(Protocol):
    """What :class:`SequenceParallelStrategy` needs of the LightningModule it runs
    (:class:`~longnet.training.CausalLMModule` is one).

    Attributes:
        pattern: the model's dilated pattern: every sequence is padded to a length whose
            shards it can run on (None: no padding; lengths must then be a multiple of the
            group size).
        pad_token_id: the input id of that padding (its labels are ``IGNORE_INDEX``).
    """

    @property
    def pattern(self) -> DilatedPattern | None: ...

    @property
    def pad_token_id(self) -> int: ...


def check_sequence_parallel_module(module: Any) -> SequenceParallelModule:
    """``module`` if it is a :class:`SequenceParallelModule`, else a ``TypeError`` naming what
    it lacks."""
    if not isinstance(module, SequenceParallelModule):
        members = ("pattern", "pad_token_id")
        missing = [name for name in members if not hasattr(module, name)] or members
        raise TypeError(
            f"SequenceParallelStrategy needs a LightningModule with 'pattern' and "
            f"'pad_token_id' (a SequenceParallelModule, e.g. longnet.training.CausalLMModule); "
            f"{type(module).__name__} has no {' or '.join(repr(name) for name in missing)}."
        )
    return module


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
        check_positive_int("sequence_parallel_size", sequence_parallel_size)
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
    def connect(self, model: Any) -> None:
        """Take the LightningModule, which must be a :class:`SequenceParallelModule`."""
        check_sequence_parallel_module(model)
        super().connect(model)

    def set_world_ranks(self) -> None:
        """Check the layout first: the Trainer calls this when it is built (before any process
        starts, so a bad layout fails at once) and again in ``setup_environment``."""
        self._check_layout()
        super().set_world_ranks()

    def setup_environment(self) -> None:
        """Start the process group (DDP) and build the mesh once; runs on every fit/test."""
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
            raise UsageError(
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
        module = check_sequence_parallel_module(self.lightning_module)
        return shard_batch(
            batch,
            self.sequence_parallel_rank,
            self.sequence_parallel_size,
            pattern=module.pattern,
            pad_token_id=module.pad_token_id,
        )
