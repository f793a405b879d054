"""The sequence-parallel Lightning strategies' common layout (:class:`SequenceParallelLayout`)
and :class:`SequenceParallelStrategy`, DDP across sequence-parallel groups (docs/training.md;
docs/architecture.md §4 for the attention across a group).

``world_size = dp * sp`` processes form a ``(dp, sp)`` device mesh: ranks
``d * sp .. d * sp + sp - 1`` are sequence-parallel group ``d`` (contiguous, so on one node
they share the fastest links). Every rank of a group reads the same samples and cuts each
sequence into its shard; the LightningModule (a :class:`SequenceParallelModule`) applies the
strategy's ``sequence_parallel`` to its model at setup (``CausalLMModule`` reads it from a
:class:`SequenceParallelLayout` strategy only; under any other strategy the model runs on
whole sequences). Gradients are averaged over all ``dp * sp`` ranks, and ``CausalLMModule``
scales its loss by ``world_size / global scored tokens``, so the update equals one device's
on the same global batch. The strategies differ only in how parameters and gradients are held:
DDP replicas here, FSDP2 shards in ``longnet.training.parallel.fsdp``.
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
        pattern: the model's dilated pattern: every sequence is padded to a length whose
            shards it can run on (None: no padding; lengths must then be a multiple of the
            group size).
        pad_token_id: the input id of that padding (its labels are ``IGNORE_INDEX``).
    """

    @property
    def pattern(self) -> DilatedPattern | None: ...

    @property
    def pad_token_id(self) -> int: ...


def check_module_protocol(
    module: Any, protocol: type, members: tuple[str, ...], strategy: str
) -> Any:
    """``module`` if it implements the runtime-checkable ``protocol`` (whose ``members`` are
    listed for the message), else a ``TypeError`` naming the ``strategy`` and what the module
    lacks."""
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
    """``module`` if it is a :class:`SequenceParallelModule`, else a ``TypeError`` naming what
    it lacks."""
    return check_module_protocol(
        module, SequenceParallelModule, ("pattern", "pad_token_id"), "SequenceParallelStrategy"
    )


_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()
"""The device meshes the strategies built (:meth:`SequenceParallelLayout._build_mesh`)."""


def _destroy_default_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # A mesh keeps its process groups, and DTensor's caches keep the mesh of a sharded run
    # for the life of the process: let the destroyed groups go, then free the run's cycles.
    for mesh in list(_MESHES):
        getattr(mesh, "_pg_registry", {}).clear()
    gc.collect()


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group (and its subgroups) when the interpreter exits,
    whatever the backend; calling it again changes nothing.

    Lightning does this for NCCL only, and torch asks every process to call
    ``destroy_process_group`` before it exits: a gloo group left to the interpreter's own
    teardown is destroyed while Python is being finalized, in no set order with its threads,
    which can abort a process whose run finished. The groups' objects are freed only with
    their last holder, so the hook also empties the group registries of the meshes the
    strategies built (DTensor's caches keep a sharded run's mesh alive) and collects the
    reference cycles of a run that is no longer reachable (DDP's reducer holds its group); a
    trainer still held by a module global keeps DDP's group to the shutdown. See
    docs/training.md ("A lost rank")."""
    atexit.unregister(_destroy_default_process_group)
    atexit.register(_destroy_default_process_group)


def keep_process_group_at_exit() -> None:
    """Undo :func:`destroy_process_group_at_exit`: after a failure, destroying the group at
    exit could wait for a collective with a lost peer until its timeout."""
    atexit.unregister(_destroy_default_process_group)


class SequenceParallelLayout:
    """The ``(data-parallel, sequence-parallel)`` layout of a Lightning strategy: a mixin put
    before a Lightning ``ParallelStrategy`` (``DDPStrategy``, ``ModelParallelStrategy``).

    It owns the ``(dp, sp)`` device mesh, the ranks, the sampler's replicas, the check that
    ``sequence_parallel_size`` divides the world, and ``batch_to_device``, which cuts every
    batch of every loop into this rank's shard (padded to fit the model's dilated pattern,
    :func:`shard_batch`). The strategy calls :meth:`_init_layout` in ``__init__`` and
    :meth:`_start_layout` once its process group is up.

    A lost rank: while a multi-process run trains, every rank beats in the process group's
    store (:class:`~longnet.distributed.watch.RankWatch`). When a rank dies mid-step (``kill
    -9``, out of memory), its peers fail fast (a closed connection) or at the collective
    timeout (a peer stuck waiting on another), and :meth:`on_exception` rewrites their error to
    name the rank that stopped (``rank 1 (pid 4242 on host h) was lost ...``) and say how to
    resume (``--ckpt_path last``).
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
        """The ``(dp, sp)`` mesh (dimension names :data:`MESH_DIMS`), built when the process
        group starts."""
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
        """Data-parallel replicas only: all ranks of a sequence-parallel group read the same
        samples."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def sequence_layout(self) -> str:
        """How every sequence is cut into this group's shards: ``"zigzag"`` with
        ``load_balance`` (rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` of ``2P``, so causal
        attention costs every rank the same), else ``"contiguous"``
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
        """How every sequence is split over :attr:`sequence_parallel_group`
        (:attr:`sequence_layout`, the ring transport), for
        :func:`longnet.distributed.parallelize`; None when the group size is 1."""
        group = self.sequence_parallel_group
        return None if group is None else SequenceParallel(group, self.sequence_layout)

    # ------------------------------------------------------------------ setup
    def set_world_ranks(self) -> None:
        """Lightning's ranks, after refusing a world the group size does not divide: the one
        layout check; it runs when the ``Trainer`` is built, before any process starts, and
        again in ``setup_environment`` before the process group starts."""
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
        """The ``(dp, sp)`` mesh over the started process group, built once (Lightning calls
        ``setup_environment`` again on every ``fit``/``test``)."""
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
        """Refuse to fit packed documents (a datamodule whose ``pack_documents`` is true) on
        zigzag shards, before any data is read: :func:`shard_batch` cuts them on contiguous
        shards only (validation and test windows hold one document each and carry no
        ``document_ids``: any layout runs them)."""
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
        """Once the process group is up (every ``fit``/``validate``/``test``): refuse packed
        documents on zigzag shards (:meth:`_check_packed_documents`), build the mesh, have the
        group destroyed when the process exits (:func:`destroy_process_group_at_exit`), start
        watching the ranks (more than one), keep Lightning's SIGTERM handler free of
        collectives (:func:`note_sigterm_without_collectives`)."""
        self._check_packed_documents()
        mesh = self._build_mesh()
        destroy_process_group_at_exit()
        if self._watch is None and self.world_size > 1:
            self._watch = RankWatch.start()
            # Every rank has written its record now: read them all while the store is sure
            # to answer (the heartbeat thread also does, but may not run in time on a busy
            # machine, and a rank lost later would then be named by number only).
            dist.barrier()
            self._watch.learn_others()
        note_sigterm_without_collectives(self.lightning_module.trainer)
        return mesh

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks this one fails; when ranks stopped (lost, or after an error of
        their own), rewrite ``exception``'s message to name them and say how to resume
        (Lightning then re-raises it). Waits ``SILENCE_SECONDS`` (3 s) to tell a lost rank from
        a live one. The process group is then left to the interpreter at exit
        (:func:`keep_process_group_at_exit`): destroying it could wait on a lost peer.

        An exception that every rank raises at the same point (``every_rank`` true: a
        ``TrainingDiverged``, a stop by a signal that all ranks agreed on) names no rank and
        keeps the group's destruction at exit: no peer is lost."""
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
        """Move the batch, then cut every sequence to this rank's shard (global positions,
        :attr:`sequence_layout`)."""
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
    """DDP over a ``(data-parallel, sequence-parallel)`` mesh (:class:`SequenceParallelLayout`).

    Select it from YAML::

        trainer:
          devices: 4
          strategy:
            class_path: longnet.training.SequenceParallelStrategy
            init_args: {sequence_parallel_size: 2}

    Args:
        sequence_parallel_size: ranks per sequence-parallel group; must divide the number of
            processes (``devices * num_nodes``). 1 is plain DDP.
        load_balance: shard every sequence in zigzag order (chunks ``r`` and ``2P - 1 - r`` of
            ``2P`` on rank ``r``) so that causal attention costs every rank the same; False
            keeps contiguous shards. Exact either way (docs/architecture.md §4).
        process_group_backend: ``"gloo"`` / ``"nccl"``; None picks by device.
        start_method: how Lightning starts the processes (see ``DDPStrategy``).
        **kwargs: passed to ``DDPStrategy`` / ``DistributedDataParallel``.

    Attributes (after setup):
        device_mesh: the ``(dp, sp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`.
        sequence_parallel_group: the process group of this rank's sequence shards (None when
            ``sequence_parallel_size == 1``).
        sequence_parallel: that group with the layout, a
            :class:`~longnet.distributed.SequenceParallel` (None when
            ``sequence_parallel_size == 1``), which ``CausalLMModule`` applies to its model.
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
        """Start the process group (DDP) and build the mesh once; runs on every fit/test."""
        super().setup_environment()
        self._start_layout()


def note_sigterm_without_collectives(trainer: pl.Trainer) -> None:
    """Make Lightning's SIGTERM handler only note the signal (and pass it on to the processes
    its launcher started), without its ``dist.broadcast``.

    Lightning (2.6) broadcasts from rank 0 inside the signal handler: a collective at whatever
    point each rank is interrupted. A rank waiting in the ring attention's point-to-point
    exchange runs its handler only once the wait ends, and the peer it waits for posts the next
    hop only after its own handler's broadcast returns: both wait until the collective timeout
    (30 min by default). The training loop already broadcasts rank 0's flag at the start of
    every batch, where every rank is at the same point, and stops all ranks together; the
    handler only needs to set the flag. (A SIGTERM to some ranks but not rank 0 stops those at
    the end of their batch; the others then stop naming them, :class:`RankWatch`.)
    """
    connector = trainer._signal_connector

    def note(signum: int, frame: Any) -> None:
        launcher = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    # register_signal_handlers (after the strategy's setup) installs this attribute
    connector._sigterm_notifier_fn = note
