"""Unit tests of the per-rank memory and communication formulas (``lab.memory``)
and of ``lab/scripts/plan_context.py``. Fast, single process; no timing."""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
import torch

from lab.memory import AttentionSetup, plan_memory
from lab.memory.local import (
    gathers_copy,
    local_backward_workspace,
    local_chunks,
    local_forward_workspace,
)
from lab.memory.ring import message_rows
from lab.scripts import plan_context
from longnet.attention import DilatedPattern
from longnet.attention.blocks import branch_groups, gather, gathers_view
from longnet.attention.plan import CPU_BLOCK_ELEMENTS, branch_chunks
from longnet.attention.plan.spanning import fits_shards, padded_length, plan_sequence_parallel
from longnet.attention.ring import pack


def _setup(**overrides) -> AttentionSetup:
    values = dict(
        batch=1,
        seq_len=16,
        world_size=2,
        num_heads=2,
        head_dim=4,
        dtype=torch.float32,
        pattern=DilatedPattern((4, 16), (1, 2)),
        causal=True,
        transport="ring",
    )
    values.update(overrides)
    return AttentionSetup(**values)


def test_bytes_sent_ring_by_hand():
    # branch (16, 2) spans both ranks (L = 8): 8 / 2 = 4 rows per head, message
    # (2, batch 1, heads 2, rows 4, dim 4) = 64 float32 = 256 bytes
    plan = plan_memory(_setup())
    for rank in plan.ranks:
        (branch,) = rank.branches
        assert branch.members == 2 and branch.rows_max == 4
        assert branch.message_bytes == 256
        assert rank.sent_forward_bytes == 256  # g - 1 hops
        assert rank.sent_backward_bytes == 256 + 2 * 256  # g - 1 K/V hops + g accumulator hops
        assert rank.received_backward_bytes == rank.sent_backward_bytes


def test_bytes_sent_allgather_causal_by_hand():
    plan = plan_memory(_setup(transport="allgather"))
    first, second = plan.ranks
    assert first.sent_forward_bytes == second.sent_forward_bytes == 256
    # causal: rank 0 attended only its own block, rank 1 sends its partial for block 0
    assert first.sent_backward_bytes == 256
    assert second.sent_backward_bytes == 256 + 256
    assert first.received_backward_bytes == 256 + 256
    assert second.received_backward_bytes == 256


def test_float64_accumulators_double_the_travelling_bytes():
    plan = plan_memory(_setup(dtype=torch.float64))
    rank = plan.ranks[0]
    assert rank.sent_forward_bytes == 512
    assert rank.sent_backward_bytes == 512 + 2 * 512


def test_forward_peak_by_hand_single_device():
    # dense [(16, 1)], float32: one whole rate-1 branch, run as one kernel call whose outputs
    # become the accumulators: out 512 B + lse 128 B, plus the CPU flash forward workspace
    # (16 * 16 + 2 * 16 + 16 * 4) * 4 B = 1408 B
    setup = _setup(world_size=1, pattern=DilatedPattern.dense(16))
    rank = plan_memory(setup).ranks[0]
    assert rank.branches == ()
    assert rank.forward_peak_bytes == 640 + 1408
    # backward: saved out 512 + lse 128 + dq, dk, dv 3 * 512 (the kernel's outputs) + the
    # contiguous lse copy 128 + workspace (2 * 16 * 16 + 16) * 4 B
    assert rank.backward_peak_bytes == 640 + 1536 + 128 + 2112


def test_message_rows_match_the_library_plan():
    # rates not dividing the shard and fewer heads than the rate: offsets drift across ranks
    pattern = DilatedPattern((12, 24, 48), (5, 7, 9))
    setup = _setup(seq_len=48, world_size=4, num_heads=3, pattern=pattern)
    for rank in range(4):
        _, rings = plan_sequence_parallel(
            pattern, 12, 4, rank, 3, ("ring",) * 3, 4, CPU_BLOCK_ELEMENTS
        )
        for (ring,), (w, r) in zip(rings, pattern.branches[1:]):
            assert message_rows(setup, w, r, rank) == ring.rows_max
            packed = pack(ring, torch.zeros(1, 12, 3, 4), torch.zeros(1, 12, 3, 4))
            memory = plan_memory(setup, ranks=[rank]).ranks[0]
            branch = next(b for b in memory.branches if b.segment_length == w)
            assert branch.message_bytes == packed.numel() * packed.element_size()


@pytest.mark.parametrize("batch", [1, 2])
def test_gather_copies_as_modelled(batch):
    setup = _setup(batch=batch, seq_len=4096, world_size=1, num_heads=4, head_dim=16)
    x = torch.zeros(batch, 4096, 4, 16)
    for w, r in ((256, 1), (512, 2), (4096, 1)):
        for group in branch_groups(4096, 4, w, r):
            for chunk in group.chunks(CPU_BLOCK_ELEMENTS, batch * 16):
                shares = gather(x, chunk).untyped_storage().data_ptr() == x.data_ptr()
                assert shares == (not gathers_copy(setup, chunk)), (w, r, chunk)
                assert shares == gathers_view(chunk, batch, 4096), (w, r, chunk)


def test_local_chunks_follow_the_chunk_bound():
    setup = _setup(seq_len=8192, world_size=1, num_heads=8, head_dim=64)
    sizes = [
        chunk.num_segments * len(chunk.heads) * chunk.rows * 64 for _, chunk in local_chunks(setup)
    ]
    assert sizes and max(sizes) <= CPU_BLOCK_ELEMENTS


def test_peak_and_saved_bytes_fall_with_world_size():
    pattern = DilatedPattern.geometric(5)
    plans = [
        plan_memory(_setup(seq_len=32768, world_size=p, num_heads=8, head_dim=64, pattern=pattern))
        for p in (1, 2, 4, 8)
    ]
    peaks = [plan.peak_bytes for plan in plans]
    saved = [plan.worst_rank.saved_bytes + plan.worst_rank.grad_bytes for plan in plans]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    assert saved == [saved[0] // p for p in (1, 2, 4, 8)]
    sent = [plan.sent_bytes_max for plan in plans]
    assert sent[0] == (0, 0) and all(f > 0 and b > f for f, b in sent[1:])


def test_setup_refuses_misaligned_lengths_with_the_library_error():
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        _setup(seq_len=24, world_size=3, pattern=DilatedPattern((12,), (1,)))
    with pytest.raises(ValueError, match="padded_length"):
        _setup(seq_len=17, world_size=2)
    with pytest.raises(ValueError, match="transport"):
        _setup(transport="ulysses")


def test_plan_context_refuses_invalid_setups(capsys):
    common = ["--devices", "3", "--layers", "2", "--heads", "4", "--head-dim", "8"]
    code = plan_context.main(
        ["--seq-len", "1000", *common, "--segments", "256,512", "--rates", "1,2", "--no-pad"]
    )
    assert code == 2
    assert "cannot be split into 3 equal shards" in capsys.readouterr().err
    code = plan_context.main(
        ["--seq-len", "1002", *common, "--segments", "256,512", "--rates", "1,2", "--no-pad"]
    )
    assert code == 2  # the library's own error (plan.spanning.plan_sequence_parallel)
    assert "branch (w=256, r=1) cannot be split over 3 ranks" in capsys.readouterr().err
    code = plan_context.main(["--seq-len", "1000", *common, "--segments", "4,8", "--rates", "8,2"])
    assert code == 2
    assert "dilation rate 8 is larger than its segment length 4" in capsys.readouterr().err


def test_plan_context_reports_the_padded_length(capsys):
    args = [
        "--seq-len",
        "1000",
        "--devices",
        "3",
        "--layers",
        "2",
        "--heads",
        "4",
        "--head-dim",
        "8",
        "--segments",
        "256,512",
        "--rates",
        "1,2",
        "--dtype",
        "float32",
    ]
    assert plan_context.main(args) == 0
    out = capsys.readouterr().out
    assert "padded length 1,536" in out  # shard 512: 256 divides it, 512 equals it
    assert "spans" not in out and "local" in out


def _padded_by_search(seq_len: int, pattern: DilatedPattern, world_size: int) -> int:
    """The definition of ``padded_length``: the first fitting length, one shard length at a
    time."""
    shard_len = -(-seq_len // world_size)
    while not fits_shards(shard_len * world_size, pattern, world_size):
        shard_len += 1
    return shard_len * world_size


def test_padded_length_is_the_first_length_that_fits():
    draw = random.Random(0)
    for _ in range(300):
        branches = sorted(draw.sample(range(1, 25), draw.randint(1, 3)))
        pattern = DilatedPattern(tuple(branches), (1,) * len(branches))
        seq_len, world = draw.randint(1, 300), draw.randint(1, 9)
        expected = _padded_by_search(seq_len, pattern, world)
        assert padded_length(seq_len, pattern, world) == expected, (branches, seq_len, world)


def _local_workspace_of_every_chunk(setup: AttentionSetup) -> tuple[int, int]:
    """``(forward, backward)`` local workspace taken over every chunk the library runs (what
    the planner computed before it looked at one chunk of each shape)."""
    every = branch_chunks(setup.local_branches, setup.row_elements, setup.block_elements,
                          setup.adopted is not None)
    with patch("lab.memory.local.local_chunks", lambda _: every):
        return local_forward_workspace(setup), local_backward_workspace(setup)


@pytest.mark.parametrize("seq_len, world, heads, batch, head_dim, dtype, branches", [
    (65536, 8, 12, 1, 64, torch.bfloat16, ((2048, 1), (4096, 2), (8192, 4))),
    (102400 * 3, 3, 12, 1, 64, torch.float32, ((2048, 1), (4096, 2), (102400, 8))),
    (72000, 6, 7, 1, 64, torch.bfloat16, ((1000, 1), (3000, 3), (12000, 5))),
    (65536, 4, 8, 3, 128, torch.float32, ((2048, 1), (4096, 2), (65536, 16))),
    (32768, 1, 12, 2, 64, torch.float64, ((32768, 1),)),
    (1 << 20, 2, 16, 1, 128, torch.float32, ((512, 1), (2048, 3), (8192, 12))),
])
def test_local_workspace_is_that_of_every_chunk(seq_len, world, heads, batch, head_dim, dtype,
                                                branches):
    setup = _setup(seq_len=seq_len, world_size=world, num_heads=heads, batch=batch,
                   head_dim=head_dim, dtype=dtype, pattern=DilatedPattern.coerce(branches))
    assert len(local_chunks(setup)) <= 2 * heads * len(branches)  # shapes, not segments
    every = _local_workspace_of_every_chunk(setup)
    assert (local_forward_workspace(setup), local_backward_workspace(setup)) == every


@pytest.mark.timeout(120)
def test_planning_time_does_not_grow_with_the_length(capsys):
    """1000M tokens took minutes and 10**21 never finished: the padding searched one shard
    length at a time and the local branches were planned segment by segment."""
    assert plan_context.main(["--seq-len", "1000M", "--devices", "8"]) == 0
    assert "padded length 1,073,741,824 (+25,165,824, 2.40%)" in capsys.readouterr().out
    assert plan_context.main(["--seq-len", str(10**21), "--devices", "1024"]) == 0
    assert "sequence 1,000,000,000,000,000,000,000 tokens" in capsys.readouterr().out
