"""Sequence lengths that shard evenly: which lengths ``world_size`` ranks can run a dilated
pattern on as they are (every branch's segment divides the shard or is a multiple of it), and
the smallest padded length that they can."""

from __future__ import annotations

import math
from collections.abc import Sequence

from longnet.attention.pattern import DilatedPattern


def branch_fits(segment_length: int, shard_len: int) -> bool:
    """Whether a branch of ``segment_length`` runs on shards of ``shard_len`` tokens: one divides
    the other."""
    return shard_len % segment_length == 0 or segment_length % shard_len == 0


def fits_shards(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> bool:
    """Whether ``world_size`` ranks run ``pattern`` on ``seq_len`` tokens as they are: the
    length divides into equal shards and every branch's segment length (capped at the
    sequence length) divides the shard length or is a multiple of it."""
    if seq_len % world_size:
        return False
    shard_len = seq_len // world_size
    pattern = DilatedPattern.coerce(pattern)
    return all(branch_fits(min(w, seq_len), shard_len) for w in pattern.segment_lengths)


def padded_length(
    seq_len: int, pattern: DilatedPattern | Sequence[tuple[int, int]], world_size: int
) -> int:
    """The smallest length ``>= seq_len`` that ``world_size`` ranks can run ``pattern`` on.

    Every branch's segment length (capped at the sequence length) must divide the shard length
    ``L = length / world_size`` or be a multiple of it. Padding at the end is exact for causal
    attention (no real query sees a later token); for bidirectional attention pad tokens are keys.
    The search skips the shard lengths that cannot fit (:func:`_next_shard_len`): a few steps
    per branch whatever the length.
    """
    pattern = DilatedPattern.coerce(pattern)
    if seq_len < 1 or world_size < 1:
        raise ValueError(
            f"padded_length: need seq_len >= 1 and world_size >= 1, got {seq_len}, {world_size}."
        )
    shard_len = -(-seq_len // world_size)
    while (longer := _next_shard_len(shard_len, pattern.segment_lengths, world_size)) > shard_len:
        shard_len = longer
    return shard_len * world_size


def _next_shard_len(shard_len: int, segment_lengths: Sequence[int], world_size: int) -> int:
    """``shard_len`` if every branch fits shards of that length (:func:`fits_shards`), else the
    next shard length that is not ruled out: segments (capped at the sequence length) up to
    ``shard_len`` must divide it, so it must be a multiple of their least common multiple; a
    longer segment ``w`` inside the sequence must be a multiple of it, so it must divide ``w``
    (the smallest divisor of ``w`` above ``shard_len``, at most ``w`` itself)."""
    segments = [min(w, shard_len * world_size) for w in segment_lengths]
    step = math.lcm(*(w for w in segments if w <= shard_len))
    if shard_len % step:
        return shard_len + step - shard_len % step
    for w in segments:
        if w > shard_len and w % shard_len:  # q < w / shard_len <= world_size candidates
            return next(w // q for q in range((w - 1) // shard_len, 0, -1) if w % q == 0)
    return shard_len
