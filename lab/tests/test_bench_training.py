"""The training-step benchmark's pieces: the dense twin, the interleaved timings, the profile's
categories, and the script end to end on a tiny model (no timing is asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab.bench.training import (
    OPTIMIZER,
    attention_pairs,
    forward_macs,
    profile_step,
    time_length,
    twin_config,
)
from longnet.attention import DilatedPattern
from longnet.modeling import LongNetConfig, LongNetLM

REPO = Path(__file__).resolve().parents[2]
TINY = LongNetConfig(hidden_size=32, num_layers=2, num_heads=2, max_positions=32,
                     segment_lengths=(8, 16), dilation_rates=(1, 2))


def test_dense_twin_is_the_same_model_with_one_full_branch():
    dense = twin_config(TINY, "dense", 64)
    assert dense.pattern.branches == ((64, 1),) and dense.max_positions == 64
    assert LongNetLM(dense).num_parameters() == LongNetLM(TINY).num_parameters()
    assert twin_config(TINY, "dilated", 16) == TINY
    with pytest.raises(ValueError, match="system"):
        twin_config(TINY, "sparse", 16)


@pytest.mark.parametrize("branches, heads, length", [
    (((8, 1), (16, 2), (32, 4)), 4, 40),   # a ragged last segment of every branch
    (((4, 1), (12, 3)), 2, 30),            # more offsets than heads: some rows are no head's
    (((64, 1),), 3, 50),                   # dense, shorter than its segment
])
def test_attention_pairs_counts_what_the_pattern_scores(branches, heads, length):
    pattern = DilatedPattern.coerce(branches)
    positions = torch.arange(length)
    counts = pattern.key_multiplicity(positions, positions, heads, causal=True)
    assert attention_pairs(pattern, length, heads) == int(counts.sum())


def test_forward_macs_matches_the_flop_counter_on_the_linear_layers():
    model = LongNetLM(TINY)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, TINY.vocab_size, (1, 24)))
    matmul_flops = sum(count for op, count in counter.get_flop_counts()["Global"].items()
                       if op.__name__.split(".")[0] in ("mm", "addmm"))
    macs = forward_macs(TINY, 24)
    assert 2 * macs["matmuls"] == matmul_flops
    pairs = attention_pairs(TINY.pattern, 24, TINY.num_heads)
    assert macs["attention"] == 2 * pairs * TINY.resolved_head_dim * TINY.num_layers


def test_time_length_gives_every_system_its_steps():
    timings = time_length(TINY, 16, batch=2, precision="32", steps=3, warmup=0)
    assert [(t.system, t.length, len(t.seconds)) for t in timings] == [
        ("dilated", 16, 3), ("dense", 16, 3)
    ]
    assert all(t.tokens_per_s == pytest.approx(32 / t.median) for t in timings)


def test_profile_has_the_optimizer_and_the_attention_kernels():
    parts = dict(profile_step(TINY, 32, batch=1, precision="32"))
    assert parts[OPTIMIZER] > 0
    assert parts["attention kernels, forward"] > 0 and parts["attention kernels, backward"] > 0
    assert all(seconds >= 0 for seconds in parts.values())


def test_script_writes_its_table_plot_and_docs_block(tmp_path: Path):
    folder = LongNetLM(TINY).save_pretrained(tmp_path / "tiny")
    spec = importlib.util.spec_from_file_location("bench_training",
                                                  REPO / "lab" / "scripts" / "bench_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    assert module.main(["--model", str(folder), "--lengths", "16", "32", "--steps", "1",
                        "--warmup", "0", "--profile", "32", "--out", str(out)]) == 0
    text = (out / "benchmarks.md").read_text()
    assert "## Training step" in text and "dilated / dense" in text and "(16, 2)" in text
    assert (out / "bench_training.png").read_bytes()[:4] == b"\x89PNG"
