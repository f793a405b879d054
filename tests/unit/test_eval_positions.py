"""Bits per byte by position and over a fixed set of scored bytes, against a loop over every
byte written out independently."""

from __future__ import annotations

import math

import numpy as np
import pytest

from longnet.eval.positions import bits_by_position, bits_from_position, position_buckets


def random_nll(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Per document ``num_bytes + 1`` NLLs (the last one the closing EOS)."""
    rng = np.random.default_rng(seed)
    return [rng.exponential(1.5, size=n + 1) for n in lengths]


def reference_bits(token_nll: list[np.ndarray], start: int, end: int) -> tuple[int, float]:
    total, count = 0.0, 0
    for values in token_nll:
        for position in range(len(values) - 1):  # the closing EOS is not a byte
            if start <= position < end:
                total += values[position]
                count += 1
    return count, (total / math.log(2) / count if count else math.nan)


def test_buckets_double_from_512_and_end_at_the_limit():
    assert position_buckets(4096) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    assert position_buckets(5000) == [
        (0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 5000)
    ]
    assert position_buckets(300) == [(0, 300)]
    assert position_buckets(40, first=8) == [(0, 8), (8, 16), (16, 32), (32, 40)]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="limit"):
            position_buckets(bad)


def test_bits_by_position_match_a_byte_by_byte_loop():
    token_nll = random_nll([3, 40, 17, 64])
    buckets = position_buckets(70, first=8)
    got = bits_by_position(token_nll, buckets)
    assert [(b.start, b.end) for b in got] == buckets
    for bucket in got:
        count, bits = reference_bits(token_nll, bucket.start, bucket.end)
        assert bucket.num_bytes == count
        if count:
            assert bucket.bits_per_byte == pytest.approx(bits, rel=1e-12)
        else:
            assert math.isnan(bucket.bits_per_byte)
    assert got[-1].num_bytes == 0  # no document reaches position 64
    assert sum(b.num_bytes for b in got) == 3 + 40 + 17 + 64  # every byte once


def test_bits_from_position_scores_the_same_bytes_whatever_the_values():
    lengths = [30, 90, 12, 64]
    first, second = random_nll(lengths, seed=1), random_nll(lengths, seed=2)
    for start in (0, 11, 12, 63, 89):
        a, b = bits_from_position(first, start), bits_from_position(second, start)
        count, bits = reference_bits(first, start, 10**9)
        assert a.num_bytes == b.num_bytes == count
        assert a.bits_per_byte == pytest.approx(bits, rel=1e-12)
    with pytest.raises(ValueError, match="longest document has 90 bytes"):
        bits_from_position(first, 90)


def test_unscored_or_malformed_inputs_are_refused():
    token_nll = random_nll([10, 10])
    token_nll[1][4] = np.nan
    with pytest.raises(ValueError, match="document 1"):
        bits_by_position(token_nll, [(0, 8)])
    with pytest.raises(ValueError, match="empty"):
        bits_by_position([], [(0, 8)])
    with pytest.raises(ValueError, match="bucket"):
        bits_by_position(random_nll([10]), [(8, 8)])
    with pytest.raises(ValueError, match="start"):
        bits_from_position(random_nll([10]), -1)
