"""Unit tests of the training-state memory model (``lab.memory.state``) and of the
training-state table of ``lab/scripts/plan_context.py``: exact parameter counts against real
models, per-rank bytes of the DDP and FSDP layouts by hand (FSDP2's padding included), errors.
Single process, no process group; the 4-process comparison with measured shards is in
``tests/distributed/test_sharded.py``."""

from __future__ import annotations

import pytest
import torch

from lab.memory.state import (
    PRECISIONS,
    ParameterShapes,
    StateDtypes,
    model_config,
    shard_elements,
    state_memory,
)
from lab.scripts import plan_context
from longnet.modeling import LongNetLM
from longnet.validation import UsageError

SMALL = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    max_positions=128,
    segment_lengths=[32, 64, 128],
    dilation_rates=[1, 2, 4],
)

HAND = ParameterShapes(root=((10, 4),), blocks=(((6,), (3, 5)), ((6,), (3, 5))))
"""82 parameters: a root of 10 x 4 and two blocks of 6 + 3 x 5."""


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # tied embeddings, MLP, xPos, biases
        dict(tie_word_embeddings=False, ffn_kind="glu", activation="silu", norm="rmsnorm"),
        dict(position_encoding="learned", num_kv_heads=2, attention_bias=False, mlp_bias=False),
        dict(sub_ln=False, head_dim=4, ffn_hidden_size=40, vocab_size=300),
    ],
)
def test_parameter_shapes_match_a_real_model(overrides):
    config = model_config("longnet-tiny", {**SMALL, **overrides})
    torch.manual_seed(0)
    model = LongNetLM(config)
    shapes = ParameterShapes.of_config(config)
    assert shapes.count == sum(p.numel() for p in model.parameters())
    real = ParameterShapes.of_model(model)
    assert shapes == real
    assert len(shapes.blocks) == config.num_layers
    # every parameter once: the root and the blocks partition the model's parameters
    assert sorted(shapes.all_shapes) == sorted(tuple(p.shape) for p in model.parameters())
    assert shapes.root[0] == (config.vocab_size, config.hidden_size)  # embeddings first


def test_tied_embeddings_are_counted_once():
    tied = ParameterShapes.of_config(model_config("longnet-tiny", SMALL))
    untied = ParameterShapes.of_config(
        model_config("longnet-tiny", {**SMALL, "tie_word_embeddings": False})
    )
    assert untied.count - tied.count == 256 * 32


def test_ddp_bytes_by_hand():
    plan = state_memory(HAND, "ddp", world_size=8, sequence_parallel_size=4, dtypes="32-true")
    assert HAND.count == 40 + 2 * (6 + 15)
    assert plan.parameter_bytes == plan.gradient_bytes == plan.bucket_bytes == 82 * 4
    assert plan.optimizer_bytes == 2 * 82 * 4
    assert plan.gathered_bytes == 0
    assert plan.total_bytes == 5 * 82 * 4
    view = state_memory(HAND, "ddp", 8, 4, "32-true", gradient_as_bucket_view=True)
    assert view.bucket_bytes == 0 and view.total_bytes == 4 * 82 * 4
    # bf16-mixed keeps float32 state; bf16-true halves it
    assert state_memory(HAND, "ddp", 8, 4, "bf16-mixed") == plan
    assert state_memory(HAND, "ddp", 8, 4, "bf16-true").total_bytes == 5 * 82 * 2


def test_fsdp_bytes_by_hand_with_padding():
    plan = state_memory(HAND, "fsdp", world_size=4, sequence_parallel_size=2, dtypes="32-true")
    # per rank, padded to ceil(rows / 4) rows: (10, 4) -> 3 x 4, (6,) -> 2, (3, 5) -> 1 x 5
    shard = 12 + 2 * (2 + 5)
    assert shard > HAND.count / 4  # 26 > 20.5: the padding
    assert plan.parameter_bytes == plan.gradient_bytes == shard * 4
    assert plan.optimizer_bytes == 2 * shard * 4
    assert plan.bucket_bytes == 0
    # root full params + grads 2 x 48, one block's params + grads 2 x 28, the next block's
    # params 28 (all-gather outputs: 4 padded shards)
    assert plan.gathered_bytes == (2 * 48 + 2 * 28 + 28) * 4
    mixed = state_memory(HAND, "fsdp", 4, 2, "bf16-mixed")
    assert mixed.parameter_bytes == shard * 4 and mixed.gathered_bytes == (2 * 48 + 3 * 28) * 2
    # one rank: FSDP holds what DDP holds, without buckets
    one = state_memory(HAND, "fsdp", 1, 1, "32-true")
    ddp = state_memory(HAND, "ddp", 1, 1, "32-true")
    assert (one.parameter_bytes, one.gradient_bytes, one.optimizer_bytes) == (
        ddp.parameter_bytes,
        ddp.gradient_bytes,
        ddp.optimizer_bytes,
    )


@pytest.mark.parametrize("shape", [(10, 4), (6,), (3, 5), (64, 3), (1,), (7, 2, 3)])
@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
def test_shard_size_is_torch_chunks_first_chunk(shape, world):
    """FSDP2 shards with ``torch.chunk`` along dim 0 and pads every rank to chunk 0's size."""
    chunks = torch.chunk(torch.empty(shape), world, dim=0)
    assert shard_elements(shape, world) == chunks[0].numel()
    assert shard_elements(shape, world) * world >= torch.Size(shape).numel()


def test_float64_state_dtypes():
    plan = state_memory(HAND, "fsdp", 4, 4, StateDtypes.uniform(torch.float64))
    assert plan.parameter_bytes == 26 * 8
    assert set(PRECISIONS) == {"32-true", "bf16-mixed", "bf16-true"}


def test_model_config_from_zoo_file_and_folder(tmp_path):
    zoo = model_config("longnet-tiny", {"num_layers": 3})
    assert zoo.num_layers == 3 and zoo.hidden_size == 256
    zoo.save(tmp_path / "config.json")
    assert model_config(tmp_path / "config.json") == zoo
    assert model_config(tmp_path, {"num_heads": 8}) == zoo.replace(num_heads=8)


def test_errors_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(UsageError, match=r"'longnet-huge' is neither a zoo name.*longnet-tiny"):
        model_config("longnet-huge")
    with pytest.raises(ValueError, match="hiden_size"):
        model_config("longnet-tiny", {"hiden_size": 8})
    with pytest.raises(UsageError, match="sequence_parallel_size=4 does not divide world_size=6"):
        state_memory(HAND, "fsdp", 6, 4)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        state_memory(HAND, "ddp", 0, 1)
    with pytest.raises(UsageError, match=r"unknown layout 'zero3'.*\['ddp', 'fsdp'\]"):
        state_memory(HAND, "zero3", 4, 1)
    with pytest.raises(UsageError, match="unknown precision '16-mixed'"):
        state_memory(HAND, "ddp", 4, 1, "16-mixed")
    with pytest.raises(FileNotFoundError, match="no LongNet config"):
        model_config(tmp_path)


MODEL_ARGS = ["--seq-len", "1000", "--devices", "2", "--model", "longnet-tiny"]
MODEL_ARGS += ["--set", "hidden_size=32", "num_layers=2", "num_heads=4", "max_positions=128"]


def test_plan_context_prints_the_training_state_per_rank(capsys):
    assert plan_context.main([*MODEL_ARGS, "--world-size", "4", "--precision", "32-true"]) == 0
    out = capsys.readouterr().out
    config = model_config("longnet-tiny", {k: SMALL[k] for k in list(SMALL)[:4]})
    shapes = ParameterShapes.of_config(config)
    assert f"{shapes.count:,} parameters (2 blocks)" in out
    assert "world 4 = 2 data-parallel x 2 sequence-parallel" in out
    assert "4 heads x 8, float32" in out  # heads and head size from the config; 32-true
    ddp = state_memory(shapes, "ddp", 4, 2, "32-true")
    fsdp = state_memory(shapes, "fsdp", 4, 2, "32-true")
    fmt = plan_context.format_bytes
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines() if line[:2] == "  "}
    assert fmt(ddp.parameter_bytes) in rows["parameters"]
    assert fmt(fsdp.parameter_bytes) in rows["parameters"]
    assert fmt(fsdp.optimizer_bytes) in rows["optimizer (AdamW x 2)"]
    assert fmt(fsdp.gathered_bytes) in rows["FSDP gathered (peak)"]
    # the model's pattern (longnet-tiny: 256/512/1024), not longnet-base-like
    assert "w=          256 r=1" in out and "2,048" not in out


def test_plan_context_refuses_bad_model_input(capsys):
    cases = [
        (
            ["--seq-len", "1000", "--devices", "2", "--model", "longnet-huge"],
            "'longnet-huge' is neither a zoo name",
        ),
        ([*MODEL_ARGS, "--world-size", "3"], "sequence_parallel_size=2 does not divide"),
        ([*MODEL_ARGS, "--layers", "4"], "--layers and --model both give the model's shape"),
        ([*MODEL_ARGS, "hiden=3"], "hiden"),
        ([*MODEL_ARGS, "num_layers"], "--set takes FIELD=VALUE, got 'num_layers'"),
        (["--seq-len", "1000", "--devices", "2", "--set", "num_layers=2"], "give --model too"),
    ]
    for argv, message in cases:
        assert plan_context.main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
