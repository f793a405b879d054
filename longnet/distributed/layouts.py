"""How a sequence is cut into the shards of a sequence-parallel group of ``P`` ranks
(docs/architecture.md §4, "Zigzag shards").

* ``contiguous``: ``P`` equal stripes; rank ``r`` holds stripe ``r``.
* ``zigzag``: ``2P`` equal stripes; rank ``r`` holds stripes ``r`` and ``2P - 1 - r``, so
  causal attention costs every rank the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, caller: str) -> None:
    """Raise ``ValueError`` naming ``caller`` when ``layout`` is not one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"{caller}: layout must be one of {LAYOUTS}, got {layout!r}.")


def stripe_count(world_size: int, layout: str) -> int:
    """How many equal stripes the sequence is cut into: ``P`` or ``2P``."""
    return 2 * world_size if layout == "zigzag" else world_size


def stripes_per_rank(layout: str) -> int:
    """How many stripes each rank's shard holds: 1 or 2."""
    return 2 if layout == "zigzag" else 1


def rank_stripes(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The stripes ``rank`` holds, in the order of its shard."""
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def stripe_host(stripe: int, world_size: int, layout: str = "zigzag") -> int:
    """The rank holding ``stripe`` (of :func:`stripe_count` stripes)."""
    if layout == "contiguous":
        return stripe
    return stripe if stripe < world_size else 2 * world_size - 1 - stripe


def stripe_slot(stripe: int, world_size: int, layout: str) -> int:
    """Where ``stripe`` lies in its host's shard: 0 (first) or 1 (second, zigzag only)."""
    return int(layout == "zigzag" and stripe >= world_size)


def shard_positions(
    seq_len: int, rank: int, world_size: int, layout: str, device: torch.device | None = None
) -> Tensor:
    """The global positions ``(seq_len / P,)`` of ``rank``'s shard, in its order.

    Raises:
        ValueError: ``seq_len`` does not cut into :func:`stripe_count` equal stripes.
    """
    stripes = stripe_count(world_size, layout)
    if seq_len % stripes:
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be cut into the {stripes} equal stripes of "
            f"the {layout} layout over {world_size} ranks; use a multiple of {stripes}."
        )
    size = seq_len // stripes
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in rank_stripes(rank, world_size, layout)])
