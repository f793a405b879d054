"""Sequence-parallel dilated attention equals the single-device result on every rank, also
with every point-to-point tag forced to 0 (NCCL ignores tags: messages match by order alone)."""

from __future__ import annotations

import pytest

from lab.workers import run_workers
from tests.distributed.retrieval_cases import check_retrieval_cases
from tests.distributed.ring_cases import check_ring_cases, check_ring_errors

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_single_device_and_reference(world_size):
    failures = run_workers(check_ring_cases, world_size, timeout=600)
    assert not any(failures), "\n".join(f for rank_failures in failures for f in rank_failures)


@pytest.mark.slow
def test_ring_matches_single_device_and_reference_world_8():
    failures = run_workers(check_ring_cases, 8, timeout=1200)
    assert not any(failures), "\n".join(f for rank_failures in failures for f in rank_failures)


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_retrieval_branches_match_single_device_and_reference(world_size):
    failures = run_workers(check_retrieval_cases, world_size, timeout=600)
    assert not any(failures), "\n".join(f for rank_failures in failures for f in rank_failures)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_calls_raise_on_every_rank(world_size):
    failures = run_workers(check_ring_errors, world_size, timeout=300)
    assert not any(failures), failures
