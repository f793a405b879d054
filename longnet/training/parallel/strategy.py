"""The sequence-parallel Lightning strategies' common layout (:class:`SequenceParallelLayout`)
and :class:`SequenceParallelStrategy`, DDP across sequence-parallel groups (docs/training.md).

``dp * sp`` processes form a ``(dp, sp)`` mesh: ranks ``d * sp .. d * sp + sp - 1`` are
sequence-parallel group ``d`` (neighbours share the fastest links). A group reads the same
samples, each rank its shard; gradients are averaged over all ranks and ``CausalLMModule``
scales its loss so the update equals one device's on the same global batch.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longnet.attention import DilatedPattern
from longnet.distributed.sequence_parallel import SequenceParallel
from longnet.distributed.watch import RankWatch
from longnet.training.parallel.batches import shard_batch
from longnet.validation import UsageError, check_positive_int

MESH_DIMS = ("dp", "sp")


@runtime_checkable
class SequenceParallelModule(Protocol):
    """What :class:`SequenceParallelStrategy` needs of the LightningModule it runs
    (:class:`~longnet.training.CausalLMModule` is one).

    Attributes:
        pattern: the model's dilated pattern, which sequences are padded to fit (None: no
            padding; lengths must be a multiple of the group size).
        pad_token_id: the input id of that padding (its labels are ``IGNORE_INDEX``).
    """

    @property
    def pattern(self) -> DilatedPattern | None: ...

    @property
    def pad_token_id(self) -> int: ...


def check_module_protocol(
    module: Any, protocol: type, members: tuple[str, ...], strategy: str
) -> Any:
    """``module`` if it implements ``protocol`` (``members`` named in the message), else a
    ``TypeError`` naming ``strategy`` and what the module lacks."""
    if not isinstance(module, protocol):
        missing = [name for name in members if not hasattr(module, name)] or members
        raise TypeError(
            f"{strategy} needs a LightningModule with "
            f"{', '.join(repr(name) for name in members)} (a {protocol.__name__}, e.g. "
            f"longnet.training.CausalLMModule); {type(module).__name__} has no "
            f"{' or '.join(repr(name) for name in missing)}."
        )
    return module


def check_sequence_parallel_module(module: Any) -> SequenceParallelModule:
    """``module`` if it is a :class:`SequenceParallelModule`, else a ``TypeError``."""
    return check_module_protocol(
        module, SequenceParallelModule, ("pattern", "pad_token_id"), "SequenceParallelStrategy"
    )


_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()
"""The device meshes the strategies built (:meth:`SequenceParallelLayout._build_mesh`)."""


def _destroy_default_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # DTensor's caches keep a sharded run's mesh (and its groups) alive: let the groups go.
    for mesh in list(_MESHES):
        getattr(mesh, "_pg_registry", {}).clear()
    gc.collect()


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group (and its subgroups) when the interpreter exits,
    whatever the backend; idempotent. Lightning does this for NCCL only, and a gloo group left
    to interpreter finalization can abort a finished run (docs/training.md, "A lost rank")."""
    atexit.unregister(_destroy_default_process_group)
    atexit.register(_destroy_default_process_group)


def keep_process_group_at_exit() -> None:
    """Undo :func:`destroy_process_group_at_exit`: after a failure, destroying the group could
    wait on a lost peer until the timeout."""
    atexit.unregister(_destroy_default_process_group)


class SequenceParallelLayout:
    """The ``(data-parallel, sequence-parallel)`` layout of a Lightning strategy: a mixin put
    before a ``ParallelStrategy`` (``DDPStrategy``, ``ModelParallelStrategy``).

    It owns the ``(dp, sp)`` mesh, the ranks, the sampler's replicas and ``batch_to_device``
    (:func:`shard_batch`). The strategy calls :meth:`_init_layout` in ``__init__`` and
    :meth:`_start_layout` once its process group is up. A lost rank is named in the others'
    errors (:class:`~longnet.distributed.watch.RankWatch`, :meth:`on_exception`).
    """

    _device_mesh: DeviceMesh | None
    _watch: RankWatch | None
    sequence_parallel_size: int

    def _init_layout(self, sequence_parallel_size: int, load_balance: bool) -> None:
        check_positive_int("sequence_parallel_size", sequence_parallel_size)
        if not isinstance(load_balance, bool):
            raise TypeError(f"load_balance must be True or False, got {load_balance!r}.")
        self.sequence_parallel_size = sequence_parallel_size
        self.load_balance = load_balance
        self._device_mesh = None
        self._watch = None

    # ------------------------------------------------------------------ layout
    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp, sp)`` mesh (:data:`MESH_DIMS`), built when the process group starts."""
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}: the device mesh is not built yet (setup_environment "
                "has not run)."
            )
        return self._device_mesh

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
        """Data-parallel replicas only: a sequence-parallel group reads the same samples."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def sequence_layout(self) -> str:
        """``"zigzag"`` with ``load_balance``, else ``"contiguous"``
        (``longnet.distributed.layouts``)."""
        return "zigzag" if self.load_balance and self.sequence_parallel_size > 1 else "contiguous"

    @property
    def sequence_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's sequence-parallel process group (None when its size is 1)."""
        if self.sequence_parallel_size == 1:
            return None
        return self.device_mesh.get_group("sp")

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """:attr:`sequence_parallel_group` with :attr:`sequence_layout` and the ring
        transport, for :func:`longnet.distributed.parallelize`; None when the size is 1."""
        group = self.sequence_parallel_group
        return None if group is None else SequenceParallel(group, self.sequence_layout)

    # ------------------------------------------------------------------ setup
    def set_world_ranks(self) -> None:
        """Lightning's ranks, after refusing a world the group size does not divide (runs
        when the ``Trainer`` is built and again before the process group starts)."""
        self._check_layout()
        super().set_world_ranks()

    def _check_layout(self) -> None:
        world = self.num_nodes * self.num_processes
        if world and world % self.sequence_parallel_size:
            raise UsageError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide the "
                f"{world} processes (devices x num_nodes = {self.num_processes} x "
                f"{self.num_nodes}); choose a divisor of {world} or change devices."
            )

    def _build_mesh(self) -> DeviceMesh:
        """The ``(dp, sp)`` mesh over the started process group, built once."""
        if self._device_mesh is None:
            device_type = "cuda" if self.root_device.type == "cuda" else "cpu"
            self._device_mesh = init_device_mesh(
                device_type,
                (self.data_parallel_size, self.sequence_parallel_size),
                mesh_dim_names=MESH_DIMS,
            )
            _MESHES.add(self._device_mesh)
        return self._device_mesh

    def _check_packed_documents(self) -> None:
        """Refuse to fit packed documents (``pack_documents``) on zigzag shards before any
        data is read (validation and test windows carry no ``document_ids``)."""
        trainer = self.lightning_module.trainer
        packed = getattr(trainer.datamodule, "pack_documents", False)
        if trainer.state.fn == TrainerFn.FITTING and self.sequence_layout == "zigzag" \
                and packed is True:
            raise UsageError(
                "packed documents (data pack_documents: true) run on contiguous sequence shards "
                "only, not on the zigzag shards of load_balance: true; set the strategy's "
                "load_balance: false (--trainer.strategy.init_args.load_balance false)."
            )

    def _start_layout(self) -> DeviceMesh:
        """Once the process group is up (every ``fit``/``validate``/``test``): check, build
        the mesh, start watching the ranks, tame the SIGTERM handler."""
        self._check_packed_documents()
        mesh = self._build_mesh()
        destroy_process_group_at_exit()
        if self._watch is None and self.world_size > 1:
            self._watch = RankWatch.start()
            # every record is written: read them now, before a rank can be lost
            dist.barrier()
            self._watch.learn_others()
        note_sigterm_without_collectives(self.lightning_module.trainer)
        return mesh

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks this one fails; when ranks stopped, rewrite ``exception``'s
        message to name them and say how to resume (waits ``SILENCE_SECONDS``). An exception
        raised by every rank at once (``every_rank``: ``TrainingDiverged``, an agreed stop)
        names no rank and keeps the group's destruction at exit."""
        super().on_exception(exception)
        every_rank = getattr(exception, "every_rank", False)
        if not every_rank:
            keep_process_group_at_exit()
        if self._watch is None:
            return
        self._watch.mark_failed(exception)
        if isinstance(exception, Exception) and not every_rank:
            message = self._watch.explain(exception)
            if message is not None:
                exception.args = (message,)

    def teardown(self) -> None:
        """Stop the rank watch, then Lightning's teardown."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        super().teardown()

    # ------------------------------------------------------------------ batches
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Move the batch, then cut every sequence to this rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sequence_parallel_size == 1:
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"{type(self).__name__} shards dict batches with 'input_ids' (and "
                f"'labels'); got {type(batch).__name__}."
            )
        module = check_sequence_parallel_module(self.lightning_module)
        return shard_batch(
            batch,
            self.sequence_parallel_rank,
            self.sequence_parallel_size,
            pattern=module.pattern,
            pad_token_id=module.pad_token_id,
            layout=self.sequence_layout,
        )


class SequenceParallelStrategy(SequenceParallelLayout, DDPStrategy):
    """DDP over a ``(dp, sp)`` mesh (:class:`SequenceParallelLayout`); select it with
    ``class_path: longnet.training.SequenceParallelStrategy``.

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; must divide
            ``devices * num_nodes``. 1 is plain DDP.
        load_balance: zigzag shards, which balance causal work; False keeps contiguous
            shards. Exact either way (docs/architecture.md §4).
        process_group_backend: ``"gloo"`` / ``"nccl"``; None picks by device.
        start_method: how Lightning starts the processes (see ``DDPStrategy``).
        **kwargs: passed to ``DDPStrategy`` / ``DistributedDataParallel``.

    Attributes (after setup):
        device_mesh: the ``(dp, sp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`.
        sequence_parallel_group: this rank's sequence-parallel group (None at size 1).
        sequence_parallel: that group with the layout, a
            :class:`~longnet.distributed.SequenceParallel` the module applies (None at size 1).
    """

    def __init__(
        self,
        sequence_parallel_size: int = 1,
        load_balance: bool = True,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self._init_layout(sequence_parallel_size, load_balance)
        super().__init__(
            process_group_backend=process_group_backend,
            start_method=start_method,
            **kwargs,
        )

    def connect(self, model: Any) -> None:
        """Take the LightningModule, which must be a :class:`SequenceParallelModule`."""
        check_sequence_parallel_module(model)
        super().connect(model)

    def setup_environment(self) -> None:
        """Start the process group (DDP) and the layout; runs on every fit/test."""
        super().setup_environment()
        self._start_layout()


def note_sigterm_without_collectives(trainer: pl.Trainer) -> None:
    """Make Lightning's SIGTERM handler only note the signal (and pass it on to the launcher's
    processes), without its ``dist.broadcast``.

    Lightning (2.6) broadcasts inside the handler, wherever each rank was interrupted: two
    ranks in the ring's point-to-point exchange then wait for each other until the collective
    timeout. The training loop already broadcasts rank 0's flag at every batch start.
    """
    connector = trainer._signal_connector

    def note(signum: int, frame: Any) -> None:
        launcher = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    # register_signal_handlers (after the strategy's setup) installs this attribute
    connector._sigterm_notifier_fn = note
