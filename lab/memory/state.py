"""Per-rank memory of the training state (parameters, gradients, AdamW moments) under the two
sequence-parallel strategies, from a model config: the part of a long-context plan that
``lab.memory``'s attention plans (the attention core's activations) leave out.

A model of what the strategies allocate, not run-time code: the library never imports it;
``lab/scripts/plan_context.py`` and the tests use it. Sizes are in **bytes per rank** (the rank
holding the most) unless a name says otherwise.

Layouts (``world = dp * sp`` ranks; the sequence-parallel size only has to divide the world:
the training state does not depend on it):

- ``"ddp"``, :class:`~longnet.training.SequenceParallelStrategy`: every rank holds
  all parameters ``P p``, their gradients ``P g``, DDP's gradient buckets ``P g`` (a flat copy of
  the gradients the all-reduce runs on; 0 with ``gradient_as_bucket_view=True``, which the
  strategy passes on to ``DistributedDataParallel``) and AdamW's two moments ``2 P m``.
- ``"fsdp"``, :class:`~longnet.training.ShardedSequenceParallelStrategy`: every block and
  the root (embeddings, final norm, LM head) ``fully_shard``-ed over all ``world`` ranks. FSDP2
  cuts each parameter along dim 0 in ``world`` chunks of ``ceil(rows / world)`` rows
  (``torch.chunk``) and stores every rank's shard padded to that size, so a rank holds
  ``S = sum over parameters of ceil(rows / world) * (numel / rows)`` elements: parameters
  ``S p``, gradient shards ``S g`` and moments ``2 S m`` (rank 0 holds full chunks; later ranks
  may hold fewer rows of the gradients and moments, never more). On top, while a step runs
  (*gathered*, transient, its peak in backward; ``reshard_after_forward=True``): the root
  unit's full parameters and full gradients (FSDP2 keeps the root gathered from its forward
  to the end of backward and reduce-scatters its gradients last), the running block's full
  parameters and full gradients, and the next block's full parameters (FSDP2's backward
  prefetch); full = ``world * ceil(rows / world)`` rows (the all-gather output), in the
  compute dtype ``c``. These come from FSDP2's design (``torch.distributed.fsdp``), not from
  a measurement.

Element sizes ``p, g, m, c`` come from the precision (:data:`PRECISIONS`). AdamW's 0-dim
``step`` counters (one scalar per parameter tensor on every rank) are not counted.
Activations other than the attention core's are not modelled here.

Usage::

    from lab.memory.state import ParameterShapes, model_config, state_memory

    shapes = ParameterShapes.of_config(model_config("longnet-base", {"num_layers": 24}))
    fsdp = state_memory(shapes, "fsdp", world_size=64, sequence_parallel_size=64)
    fsdp.total_bytes
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longnet.modeling import LongNetConfig, LongNetLM
from longnet.modeling.zoo import ZOO
from longnet.validation import UsageError, check_positive_int

Shape = tuple[int, ...]

LAYOUTS = {
    "ddp": "SequenceParallelStrategy (DDP)",
    "fsdp": "ShardedSequenceParallelStrategy (FSDP2)",
}
"""Layout name: the strategy whose training state it models."""


@dataclass(frozen=True)
class StateDtypes:
    """Element dtypes of the training state.

    Attributes:
        param: the parameters the optimizer updates (FSDP: the sharded parameters).
        grad: their gradients (FSDP: the gradient shards; DDP: ``.grad`` and the buckets).
        moment: each of AdamW's two moments (``exp_avg``, ``exp_avg_sq``: ``zeros_like`` of the
            parameter).
        compute: FSDP's all-gathered parameters and the block's unsharded gradients (the
            mixed-precision policy's ``param_dtype``).
    """

    param: torch.dtype
    grad: torch.dtype
    moment: torch.dtype
    compute: torch.dtype

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> StateDtypes:
        """Everything in ``dtype`` (``32-true``; a float64 model under ``32-true`` keeps
        float64)."""
        return cls(dtype, dtype, dtype, dtype)


PRECISIONS: dict[str, StateDtypes] = {
    "32-true": StateDtypes.uniform(torch.float32),
    "bf16-mixed": StateDtypes(torch.float32, torch.float32, torch.float32, torch.bfloat16),
    "bf16-true": StateDtypes.uniform(torch.bfloat16),
}
"""Lightning precision -> state dtypes. ``bf16-mixed``: float32 parameters, gradients and
moments (autocast casts only the compute), and FSDP gathering in bfloat16, i.e. the strategy's
``param_dtype: bfloat16`` (under autocast alone FSDP gathers float32: twice the *gathered*
bytes). ``bf16-true``: the model in bfloat16, so AdamW's moments too."""


@dataclass(frozen=True)
class ParameterShapes:
    """Shapes of a model's distinct parameters (tied ones once), per FSDP unit.

    Attributes:
        root: parameters outside the blocks (embeddings, final norm, LM head): the root unit.
        blocks: one tuple of shapes per transformer block (``model.model.layers``), each one
            FSDP unit, in order.
    """

    root: tuple[Shape, ...]
    blocks: tuple[tuple[Shape, ...], ...]

    @classmethod
    def of_model(cls, model: LongNetLM) -> ParameterShapes:
        """The shapes of ``model``'s parameters (any device, ``meta`` included)."""
        in_blocks: set[int] = set()
        blocks = []
        for block in model.model.layers:
            blocks.append(tuple(tuple(p.shape) for p in block.parameters()))
            in_blocks.update(id(p) for p in block.parameters())
        root = tuple(tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks)
        return cls(root=root, blocks=tuple(blocks))

    @classmethod
    def of_config(cls, config: LongNetConfig) -> ParameterShapes:
        """The shapes of :class:`~longnet.modeling.LongNetLM` built from ``config`` on the
        ``meta`` device (no memory, exact whatever the config)."""
        with torch.device("meta"):
            model = LongNetLM(config)
        return cls.of_model(model)

    @property
    def all_shapes(self) -> tuple[Shape, ...]:
        return self.root + tuple(shape for block in self.blocks for shape in block)

    @property
    def count(self) -> int:
        """Number of parameters (elements)."""
        return sum(math.prod(shape) for shape in self.all_shapes)


def shard_elements(shape: Shape, world_size: int) -> int:
    """Elements of one rank's padded FSDP2 shard of a parameter of ``shape``:
    ``ceil(rows / world) * (numel / rows)`` with ``rows = shape[0]``."""
    rows = shape[0]
    return -(-rows // world_size) * (math.prod(shape) // rows)


def _unit_elements(shapes: tuple[Shape, ...], world_size: int) -> int:
    """Elements of a unit's all-gathered parameters: ``world`` padded shards of each."""
    return world_size * sum(shard_elements(shape, world_size) for shape in shapes)


@dataclass(frozen=True)
class StateMemory:
    """Training-state bytes on the rank holding the most, for one layout.

    Attributes:
        layout: ``"ddp"`` or ``"fsdp"`` (:data:`LAYOUTS`).
        world_size: ranks (``dp * sp``).
        parameter_bytes: parameters (FSDP: the padded shard).
        gradient_bytes: gradients (FSDP: the gradient shards).
        bucket_bytes: DDP's gradient buckets (0 for FSDP, or with ``gradient_as_bucket_view``).
        optimizer_bytes: AdamW's two moments.
        gathered_bytes: FSDP's transient full parameters and gradients (0 for DDP).
    """

    layout: str
    world_size: int
    parameter_bytes: int
    gradient_bytes: int
    bucket_bytes: int
    optimizer_bytes: int
    gathered_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.bucket_bytes
            + self.optimizer_bytes
            + self.gathered_bytes
        )


def check_world(world_size: int, sequence_parallel_size: int) -> None:
    """``UsageError`` unless ``sequence_parallel_size`` divides ``world_size`` (both positive
    integers), as the strategies require."""
    check_positive_int("world_size", world_size)
    check_positive_int("sequence_parallel_size", sequence_parallel_size)
    if world_size % sequence_parallel_size:
        raise UsageError(
            f"sequence_parallel_size={sequence_parallel_size} does not divide world_size="
            f"{world_size}; the world is data-parallel groups of sequence_parallel_size ranks: "
            f"choose a world size that is a multiple of {sequence_parallel_size}."
        )


def state_memory(
    shapes: ParameterShapes,
    layout: str,
    world_size: int,
    sequence_parallel_size: int,
    dtypes: StateDtypes | str = "bf16-mixed",
    gradient_as_bucket_view: bool = False,
) -> StateMemory:
    """Per-rank bytes of parameters, gradients and AdamW state for ``layout``.

    Args:
        shapes: the model's parameters (:meth:`ParameterShapes.of_config`).
        layout: ``"ddp"`` or ``"fsdp"``.
        world_size: all ranks, ``dp * sp``.
        sequence_parallel_size: ranks per sequence; must divide ``world_size``.
        dtypes: a :data:`PRECISIONS` name or :class:`StateDtypes`.
        gradient_as_bucket_view: DDP's option (gradients are views of the buckets).

    Raises:
        UsageError: an unknown layout or precision, or a world the sequence-parallel size does
            not divide.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUTS)}.")
    check_world(world_size, sequence_parallel_size)
    if isinstance(dtypes, str):
        if dtypes not in PRECISIONS:
            raise UsageError(f"unknown precision {dtypes!r}; choose one of {sorted(PRECISIONS)}.")
        dtypes = PRECISIONS[dtypes]
    p, g, m, c = (d.itemsize for d in (dtypes.param, dtypes.grad, dtypes.moment, dtypes.compute))
    if layout == "ddp":
        count = shapes.count
        return StateMemory(
            layout=layout,
            world_size=world_size,
            parameter_bytes=count * p,
            gradient_bytes=count * g,
            bucket_bytes=0 if gradient_as_bucket_view else count * g,
            optimizer_bytes=2 * count * m,
            gathered_bytes=0,
        )
    shard = sum(shard_elements(shape, world_size) for shape in shapes.all_shapes)
    block = max((_unit_elements(b, world_size) for b in shapes.blocks), default=0)
    prefetched = block if len(shapes.blocks) > 1 else 0
    gathered = 2 * _unit_elements(shapes.root, world_size) + 2 * block + prefetched
    return StateMemory(
        layout=layout,
        world_size=world_size,
        parameter_bytes=shard * p,
        gradient_bytes=shard * g,
        bucket_bytes=0,
        optimizer_bytes=2 * shard * m,
        gathered_bytes=gathered * c,
    )


def model_config(source: str | Path, overrides: Mapping[str, Any] | None = None) -> LongNetConfig:
    """The config to plan: a zoo name (``longnet.modeling.zoo.ZOO``), a model folder or a
    ``config.json`` path, with fields replaced by ``overrides`` (``{"num_layers": 24}``).

    Raises:
        UsageError: ``source`` is neither a zoo name nor an existing file or folder (the
            message lists the zoo), or a file that is not text (a checkpoint, weights).
        ValueError: an unknown or invalid field (the config's own error).
    """
    overrides = dict(overrides or {})
    if str(source) in ZOO:
        return ZOO[str(source)].config.replace(**overrides)
    path = Path(source)
    if path.exists():
        try:
            return LongNetConfig.load(path, **overrides)
        except UnicodeDecodeError:
            raise UsageError(
                f"model {source} is not a config.json (not text: a checkpoint or weights?); "
                "give a zoo name, a model folder or its config.json (export a .ckpt with "
                "longnet export)."
            ) from None
    raise UsageError(
        f"model {str(source)!r} is neither a zoo name nor a config.json file or model folder; "
        f"zoo names: {', '.join(ZOO)}."
    )
