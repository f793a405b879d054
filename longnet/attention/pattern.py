"""The dilated pattern: which keys each query sees (docs/architecture.md §2). Branches ``(w, r)``
cut the sequence into segments of ``w`` tokens; in each, head ``h`` selects positions ``s + h %
r + j * r``, a selected query attending to its segment's selected keys. The output is one
softmax over the multiset union of all branches' keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from longnet.validation import check_positive_int, is_int


@dataclass(frozen=True)
class DilatedPattern:
    """Segment lengths (strictly increasing) and dilation rates (each at most its segment):
    ``DilatedPattern((2048, 4096), (1, 2))`` or ``DilatedPattern([(2048, 1), (4096, 2)])``."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...] = None  # type: ignore[assignment]  # None: pairs given

    def __post_init__(self) -> None:
        if self.dilation_rates is None:
            segments, rates = _split_pairs(self.segment_lengths)
        else:
            segments, rates = tuple(self.segment_lengths), tuple(self.dilation_rates)
        object.__setattr__(self, "segment_lengths", segments)
        object.__setattr__(self, "dilation_rates", rates)
        if len(segments) == 0:
            raise ValueError("pattern: segment_lengths is empty; give at least one branch.")
        if len(segments) != len(rates):
            raise ValueError(
                f"pattern: segment_lengths has {len(segments)} entries but dilation_rates has "
                f"{len(rates)}; give one dilation rate per segment length."
            )
        for name, values in (("segment_lengths", segments), ("dilation_rates", rates)):
            for value in values:
                if not is_int(value) or value <= 0:
                    raise ValueError(f"pattern: {name} must be positive integers, got {values}.")
        if any(b <= a for a, b in zip(segments, segments[1:])):
            raise ValueError(
                f"pattern: segment_lengths must be strictly increasing, got {segments}; "
                "sort the branches by segment length and merge duplicates."
            )
        for w, r in zip(segments, rates):
            if r > w:
                raise ValueError(
                    f"pattern: dilation rate {r} is larger than its segment length {w}; "
                    "use a rate of at most the segment length."
                )

    @classmethod
    def coerce(cls, pattern: DilatedPattern | Iterable[tuple[int, int]]) -> DilatedPattern:
        """Accept a ``DilatedPattern`` or a list of ``(segment_length, dilation_rate)`` pairs."""
        return pattern if isinstance(pattern, DilatedPattern) else cls(pattern)

    @classmethod
    def dense(cls, max_length: int) -> DilatedPattern:
        """Plain full attention for sequences of up to ``max_length`` tokens."""
        return cls((max_length,), (1,))

    @classmethod
    def geometric(cls, num_branches: int, base_segment: int = 2048) -> DilatedPattern:
        """LongNet's geometric pattern: ``w = base_segment * 2**i``, ``r = 2**i``."""
        num_branches = check_positive_int("num_branches", num_branches)
        base_segment = check_positive_int("base_segment", base_segment)
        return cls(
            tuple(base_segment * 2**i for i in range(num_branches)),
            tuple(2**i for i in range(num_branches)),
        )

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        """The ``(segment_length, dilation_rate)`` pairs."""
        return tuple(zip(self.segment_lengths, self.dilation_rates))

    def key_multiplicity(
        self,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        num_heads: int,
        causal: bool,
    ) -> torch.Tensor:
        """How many branches give each query each key, per head.

        Args:
            query_positions: ``(q,)`` global positions of the queries.
            key_positions: ``(k,)`` global positions of the keys.
        Returns:
            ``(num_heads, q, k)`` int64 counts ``C``;
            attention is ``softmax(q k^T * scale + log C)``.
        """
        heads = torch.arange(num_heads, device=query_positions.device)[:, None, None]
        p = query_positions[None, :, None]
        t = key_positions[None, None, :]
        counts = torch.zeros(
            num_heads,
            len(query_positions),
            len(key_positions),
            dtype=torch.int64,
            device=query_positions.device,
        )
        for w, r in self.branches:
            offset = heads % r
            same_segment = (p // w) == (t // w)
            selected = (((p % w) % r) == offset) & (((t % w) % r) == offset)
            counts += (same_segment & selected).long()
        if causal:
            counts = counts * (t <= p)
        return counts


def _split_pairs(pairs: Iterable[tuple[int, int]]) -> tuple[tuple, tuple]:
    """``pairs`` split into segment lengths and rates (``TypeError``/``ValueError`` else)."""
    try:
        if isinstance(pairs, (str, bytes)):  # iterable, but never pairs
            raise TypeError
        items = list(pairs)
    except TypeError:
        raise TypeError(
            "pattern must be a DilatedPattern or a list of (segment_length, dilation_rate) "
            f"pairs such as [(2048, 1), (4096, 2)], got {type(pairs).__name__} {pairs!r}."
        ) from None
    if items and all(is_int(item) for item in items):
        example = tuple(2**i for i in range(len(items)))
        raise ValueError(
            f"pattern: segment_lengths {tuple(items)} come without dilation_rates; give one "
            f"rate per segment length, e.g. DilatedPattern(segment_lengths={tuple(items)}, "
            f"dilation_rates={example}), or the pairs DilatedPattern("
            f"{list(zip(items, example))})."
        )
    try:
        split = [tuple(item) for item in items]
    except TypeError:
        split = []
    if len(split) != len(items) or any(len(pair) != 2 for pair in split):
        raise ValueError(
            f"pattern: every entry must be a (segment_length, dilation_rate) pair, got {items}."
        )
    return tuple(w for w, _ in split), tuple(r for _, r in split)
