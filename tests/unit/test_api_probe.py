"""Bad arguments of the Python API found by probing it as a new user (issue 41, items 6, 7, 11,
12, and the sweep of their class): layers validate their arguments with the config's checks,
flags must be real bools, numbers of the wrong type are named as such, and the Hugging Face
entry points say what to load instead of a run folder, a ``.ckpt`` or a folder without
tokenizer files. Tiny random models; nothing is downloaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longnet.attention import DilatedPattern, dilated_attention
from longnet.distributed import SequenceParallel
from longnet.modeling import LongNetConfig, LongNetLM
from longnet.nn import (
    MLP,
    CausalShortConv,
    GatedMLP,
    KVCache,
    LearnedPositionalEmbedding,
    MultiheadDilatedAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    XPos,
    build_norm,
    default_position_ids,
)

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


def make_lm(**overrides) -> LongNetLM:
    torch.manual_seed(0)
    return LongNetLM(LongNetConfig(**TINY, **overrides)).eval()


def attention(**kwargs) -> MultiheadDilatedAttention:
    return MultiheadDilatedAttention(**{"embed_dim": 32, "num_heads": 2, "pattern": [(8, 1)],
                                        **kwargs})


# ---------------------------------------------------------------- item 6: the config's checks
@pytest.mark.parametrize("sub_ln", [True, False])
@pytest.mark.parametrize("eps", [-1.0, 0.0, float("nan")])
def test_attention_layer_refuses_the_norm_eps_the_config_refuses(sub_ln, eps):
    with pytest.raises(ValueError, match=f"norm_eps must be a finite positive number, got {eps}"):
        attention(sub_ln=sub_ln, norm_eps=eps)
    with pytest.raises(ValueError, match="norm_eps must be a finite positive number"):
        LongNetConfig(**TINY, sub_ln=sub_ln, norm_eps=eps)


@pytest.mark.parametrize("make", [
    lambda: MLP(32, 64, sub_ln=True, norm_eps=-1.0),
    lambda: GatedMLP(32, 64, norm_eps=0),
    lambda: build_norm("rmsnorm", 32, -1.0),
    lambda: build_norm("layernorm", 32, -1.0),
])
def test_feed_forward_and_norms_refuse_a_non_positive_eps(make):
    with pytest.raises(ValueError, match="norm_eps must be a finite positive number"):
        make()


def test_rmsnorm_refuses_a_non_positive_eps():
    with pytest.raises(ValueError, match="eps must be a finite positive number, got 0"):
        RMSNorm(8, eps=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(norm="batchnorm"), "norm must be one of .*'batchnorm'"),
    (dict(output_dropout="0.1"), r"output_dropout must be a number in \[0, 1\), got '0.1'"),
    (dict(scale=-1.0), "scale must be a finite positive number, got -1.0"),
    (dict(scale="0.3"), "scale must be a number .*not a str: got '0.3'"),
    (dict(kv_conv_size=1), "kv_conv_size must be 0 .* at least 2, got 1"),
])
def test_attention_layer_refuses_what_the_config_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention(**kwargs)


def test_a_dropout_out_of_range_names_it_in_the_config_and_the_layer():
    for make in (lambda: LongNetConfig(**TINY, dropout=1.5),
                 lambda: attention(output_dropout=1.5)):
        with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\), got 1.5"):
            make()


# ---------------------------------------------------------------- item 7: real bools
@pytest.mark.parametrize("call", [
    lambda: make_lm().generate(torch.tensor([[1, 2]]), 2, use_cache="no"),
    lambda: attention(bias="no"),
    lambda: attention(sub_ln="no"),
    lambda: MLP(32, 64, bias="no"),
    lambda: MLP(32, 64, sub_ln="no"),
    lambda: TransformerBlock(attention(), MLP(32, 64), RMSNorm(32), RMSNorm(32),
                             gradient_checkpointing="no"),
    lambda: make_lm().set_gradient_checkpointing("no"),
    lambda: LongNetConfig(**TINY, sub_ln="yes"),
])
def test_a_flag_given_as_a_string_is_refused(call):
    with pytest.raises(TypeError, match=r"must be True or False, got '(no|yes)'"):
        call()


def test_generate_refuses_a_generator_that_is_not_one():
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int 0"):
        make_lm().generate(torch.tensor([[1, 2]]), 2, generator=0)


def test_generate_names_a_tensor_temperature_as_a_type_error():
    with pytest.raises(ValueError, match=r"temperature must be a number .*not a Tensor"):
        make_lm().generate(torch.tensor([[1, 2]]), 2, temperature=torch.tensor(0.5))


# ---------------------------------------------------------------- item 11: unclear messages
def test_a_tensor_scale_is_named_as_the_wrong_type():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match=r"scale must be a number \(an int or a float\), not a "
                       r"Tensor: got tensor\(0.3000\); pass x.item\(\) for a one-element tensor"):
        dilated_attention(q, q, q, [(8, 1)], scale=torch.tensor(0.3))


def test_dilated_pattern_takes_pairs_as_dilated_attention_does():
    pairs = [(8, 1), (16, 2)]
    assert DilatedPattern(pairs) == DilatedPattern((8, 16), (1, 2)) == DilatedPattern.coerce(pairs)
    assert DilatedPattern(segment_lengths=[(8, 1)]).branches == ((8, 1),)
    q = torch.randn(1, 16, 2, 8)
    assert torch.equal(dilated_attention(q, q, q, pairs), dilated_attention(q, q, q,
                                                                            DilatedPattern(pairs)))


def test_dilated_pattern_without_rates_says_both_ways_to_give_them():
    with pytest.raises(ValueError, match=r"\(8, 16\) come without dilation_rates.*e.g. "
                       r"DilatedPattern\(segment_lengths=\(8, 16\), dilation_rates=\(1, 2\)\), "
                       r"or the pairs DilatedPattern\(\[\(8, 1\), \(16, 2\)\]\)"):
        DilatedPattern((8, 16))


@pytest.mark.parametrize("size", [2.5, "3", True])
def test_attention_layer_refuses_a_kv_conv_size_that_is_no_integer(size):
    with pytest.raises(ValueError, match=f"kv_conv_size must be 0 .*got {size!r}"):
        attention(kv_conv_size=size)


@pytest.mark.parametrize("call", [
    lambda: default_position_ids(16, torch.device("cpu"), group="world"),
    lambda: SequenceParallel("world"),
])
def test_a_group_that_is_not_a_process_group_is_refused(call):
    with pytest.raises(TypeError, match=r"must be a torch.distributed.ProcessGroup( or None)?, "
                       r"got str 'world'"):
        call()


def test_a_group_passed_where_the_cache_goes_is_refused():
    layer = attention(kv_conv_size=2)
    with pytest.raises(TypeError, match="cache must be a LayerKVCache or None, got str 'world'"):
        layer(torch.randn(1, 16, 32), torch.arange(16), "world")


# ---------------------------------------------------------------- the sweep: numbers, names
@pytest.mark.parametrize("make, match", [
    (lambda: MLP(32, "64"), "hidden_dim must be a positive integer, got '64'"),
    (lambda: MLP(32.0, 64), "embed_dim must be a positive integer, got 32.0"),
    (lambda: MLP(32, 64, dropout=2), r"dropout must be a number in \[0, 1\), got 2"),
    (lambda: RMSNorm("8"), "dim must be a positive integer, got '8'"),
    (lambda: RotaryEmbedding(8, theta=-1.0), "theta must be a finite positive number, got -1.0"),
    (lambda: RotaryEmbedding(8, theta="1e4"), "theta must be a number .*not a str"),
    (lambda: RotaryEmbedding(8.0), "head_dim must be a positive integer, got 8.0"),
    (lambda: XPos(8, block_size="16"), "block_size must be a positive integer, got '16'"),
    (lambda: XPos(8, 16, scale_base=float("inf")), "scale_base must be a finite positive"),
    (lambda: CausalShortConv(8, 2.5), "kernel_size must be a positive integer, got 2.5"),
    (lambda: LearnedPositionalEmbedding("64", 8), "max_positions must be a positive integer"),
    (lambda: KVCache("2"), "num_layers must be a non-negative integer, got '2'"),
    (lambda: DilatedPattern.geometric("3"), "num_branches must be a positive integer, got '3'"),
    (lambda: DilatedPattern.geometric(2, base_segment=8.5), "base_segment must be a positive"),
])
def test_building_blocks_name_a_number_of_the_wrong_type(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_building_blocks_take_numpy_numbers():
    rope = RotaryEmbedding(np.int64(8), theta=np.float32(1e4))
    assert type(rope.head_dim) is int and rope.theta == 1e4
    layer = attention(scale=np.float64(0.25), norm_eps=np.float32(1e-5), sub_ln=True,
                      kv_conv_size=np.int64(2))
    assert layer.scale == 0.25 and layer.kv_conv.kernel_size == 2
    assert layer(torch.randn(1, 8, 32)).isfinite().all()


def test_attention_layer_refuses_a_positional_that_is_no_module():
    with pytest.raises(TypeError, match=r"positional must be a module .*RotaryEmbedding.*"
                       r"got str 'rope'"):
        attention(positional="rope")
