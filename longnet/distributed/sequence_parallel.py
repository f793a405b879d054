"""Sequence parallelism as one object (:class:`SequenceParallel`), applied to a model from
outside (:func:`parallelize`, as in torchtitan), so ``forward`` takes only data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from longnet.distributed.layouts import LAYOUTS, check_layout

TRANSPORTS = ("ring", "allgather")
"""``ring``: blocks move one rank per hop; ``allgather``: all at once (LongNet's scheme)."""


def check_process_group(name: str, group: object, allow_none: bool = True) -> None:
    """Raise ``TypeError`` unless ``group`` (the argument ``name``) is a
    ``torch.distributed.ProcessGroup`` (or None, with ``allow_none``)."""
    if (group is None and allow_none) or isinstance(group, dist.ProcessGroup):
        return
    raise TypeError(
        f"{name} must be a torch.distributed.ProcessGroup{' or None' if allow_none else ''}, "
        f"got {type(group).__name__} {group!r}; pass the group of the ranks sharing the "
        "sequence (torch.distributed.new_group, or torch.distributed.group.WORLD)"
        f"{', or None on one device' if allow_none else ''}."
    )


@dataclass(frozen=True)
class SequenceParallel:
    """How a sequence is split over the ranks of ``process_group``.

    Args:
        process_group: the ranks sharing each sequence; each passes its shard of ``N / P``
            tokens.
        layout: ``"contiguous"`` or ``"zigzag"`` (``longnet.distributed.layouts``).
        transport: how branches whose segments span ranks move K/V: ``"ring"`` or
            ``"allgather"``, for all branches or one per branch (checked when attention
            runs). ``zigzag`` runs ``ring`` only.

    Raises:
        TypeError: ``process_group`` is not a ``ProcessGroup``.
        ValueError: an unknown layout or transport, or ``zigzag`` with ``allgather``.
    """

    process_group: dist.ProcessGroup
    layout: str = "contiguous"
    transport: str | tuple[str, ...] = "ring"

    def __post_init__(self) -> None:
        check_process_group("SequenceParallel: process_group", self.process_group,
                            allow_none=False)
        check_layout(self.layout, "SequenceParallel")
        names = (self.transport,) if isinstance(self.transport, str) else self.transport
        if not isinstance(names, Sequence) or not names or any(
            name not in TRANSPORTS for name in names
        ):
            raise ValueError(
                f"SequenceParallel: transport must be one of {TRANSPORTS} or a sequence of "
                f"them (one per branch), got {self.transport!r}."
            )
        if not isinstance(self.transport, str):
            object.__setattr__(self, "transport", tuple(self.transport))
        if self.layout == "zigzag" and "allgather" in names:
            raise ValueError(
                "SequenceParallel: the zigzag layout runs the ring transport only; pass "
                "transport='ring' or layout='contiguous'."
            )

    @property
    def world_size(self) -> int:
        """The number of ranks in ``process_group``."""
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        """This process's rank in ``process_group``."""
        return dist.get_rank(self.process_group)


def parallelize(model: nn.Module, sequence_parallel: SequenceParallel | None) -> nn.Module:
    """Set ``sequence_parallel`` on every module of ``model`` that has that attribute (None:
    one device again); returns ``model``, changed in place (not saved with it). Then every
    ``forward`` takes and returns this rank's shard; all ranks of the group must run the same
    calls.

    Raises:
        TypeError: ``model`` is not a module, or ``sequence_parallel`` is neither a
            :class:`SequenceParallel` nor None.
        ValueError: no module of ``model`` reads it (not a longnet model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}; pass "
            "the longnet model (LongNetLM, LongNetModel, MultiheadDilatedAttention)."
        )
    if sequence_parallel is not None and not isinstance(sequence_parallel, SequenceParallel):
        raise TypeError(
            "parallelize: sequence_parallel must be a longnet.distributed.SequenceParallel or "
            f"None, got {type(sequence_parallel).__name__}."
        )
    readers = [m for m in model.modules() if hasattr(m, "sequence_parallel")]
    if not readers:
        raise ValueError(
            f"parallelize: no module of {type(model).__name__} reads a sequence_parallel "
            "setting; pass a longnet model or layer (LongNetLM, LongNetModel, "
            "MultiheadDilatedAttention)."
        )
    for module in readers:
        module.sequence_parallel = sequence_parallel
    return model


__all__ = [
    "LAYOUTS", "TRANSPORTS", "SequenceParallel", "check_process_group",
    "parallelize",
]
