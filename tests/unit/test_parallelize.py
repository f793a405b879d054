"""Sequence parallelism applied from outside (``longnet.distributed.SequenceParallel``,
``parallelize``) on a one-rank gloo group in this process (the multi-rank exactness runs in
``tests/unit/test_modeling.py`` and ``tests/distributed``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longnet.distributed import SequenceParallel, parallelize
from longnet.modeling import LongNetConfig, LongNetEncoder, LongNetLM
from longnet.nn import MultiheadDilatedAttention

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=64,
            segment_lengths=(4, 8), dilation_rates=(1, 2), kv_conv_size=3)


@pytest.fixture
def group():
    """The WORLD group of a one-rank gloo process group, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def make_lm(**overrides) -> LongNetLM:
    torch.manual_seed(0)
    return LongNetLM(LongNetConfig(**TINY, **overrides)).double()


def readers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "sequence_parallel")]


# ---------------------------------------------------------------- SequenceParallel
def test_sequence_parallel_refuses_what_is_not_a_process_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"
                       ", got str 'world'"):
        SequenceParallel("world")


@pytest.mark.parametrize("fields, match", [
    (dict(layout="striped"), r"layout must be one of \('contiguous', 'zigzag'\), got 'striped'"),
    (dict(transport="p2p"), r"transport must be one of \('ring', 'allgather'\) .*got 'p2p'"),
    (dict(transport=()), "transport must be one of"),
    (dict(transport=("ring", "bus")), "transport must be one of"),
    (dict(layout="zigzag", transport="allgather"), "zigzag layout runs the ring transport only"),
    (dict(layout="zigzag", transport=("ring", "allgather")), "runs the ring transport only"),
])
def test_sequence_parallel_refuses_a_combination_that_cannot_run(group, fields, match):
    with pytest.raises(ValueError, match=match):
        SequenceParallel(group, **fields)


def test_sequence_parallel_keeps_its_fields(group):
    sp = SequenceParallel(group, "zigzag", ["ring", "ring"])
    assert (sp.layout, sp.transport, sp.world_size, sp.rank) == ("zigzag", ("ring", "ring"), 1, 0)
    assert SequenceParallel(group).layout == "contiguous"


# ---------------------------------------------------------------- parallelize
def test_parallelize_sets_every_reader_and_nothing_else(group):
    model = make_lm()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    config = model.config.to_dict()
    sp = SequenceParallel(group)
    assert parallelize(model, sp) is model
    # the backbone (default positions) and every attention layer read it
    assert len(readers(model)) == 1 + TINY["num_layers"]
    assert all(m.sequence_parallel is sp for m in readers(model))
    assert model.state_dict().keys() == state.keys() and model.config.to_dict() == config
    parallelize(model, None)
    assert all(m.sequence_parallel is None for m in readers(model))


@pytest.mark.parametrize("call, error, match", [
    (lambda: parallelize("model", None), TypeError, "model must be a torch.nn.Module, got str"),
    (lambda: parallelize(make_lm(), "world"), TypeError,
     "sequence_parallel must be a longnet.distributed.SequenceParallel or None, got str"),
    (lambda: parallelize(torch.nn.Linear(2, 2), None), ValueError,
     "no module of Linear reads a sequence_parallel setting"),
])
def test_parallelize_refuses_what_it_cannot_apply(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_parallelized_model_on_one_rank_equals_the_plain_model(group):
    """A group of one rank runs every sequence-parallel code path (default positions, the
    K/V convolution's halo, the attention call) and must give the one-device results."""
    model = make_lm(gradient_checkpointing=True)
    x = torch.randint(0, 256, (2, 16))
    plain = model(x[:, :-1], targets=x[:, 1:])
    plain.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    parallelize(model, SequenceParallel(group))
    parallel = model(x[:, :-1], targets=x[:, 1:])
    parallel.loss.backward()
    assert torch.equal(parallel.logits, plain.logits)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_transport_per_branch_is_checked_against_the_pattern_on_one_rank(group):
    """One transport per branch: a count that does not match the pattern is refused on a
    one-rank group too, not first on a multi-rank run."""
    model = parallelize(make_lm(), SequenceParallel(group, transport=["ring", "allgather",
                                                                      "ring"]))
    with pytest.raises(ValueError, match=r"one per branch \(2\), got \('ring', 'allgather', "
                       "'ring'\\)"):
        model(torch.randint(0, 256, (1, 16)))
    parallelize(model, SequenceParallel(group, transport=["ring", "allgather"]))
    assert model(torch.randint(0, 256, (1, 16))).logits.shape == (1, 16, 256)


def test_the_encoder_pools_over_a_parallelized_group(group):
    torch.manual_seed(0)
    encoder = LongNetEncoder(LongNetConfig(**TINY, pooling="last", num_labels=3)).double()
    x = torch.randint(0, 256, (2, 16))
    plain = encoder(x).logits
    parallelize(encoder, SequenceParallel(group))
    assert encoder.sequence_parallel is not None
    assert torch.equal(encoder(x).logits, plain)


@pytest.mark.parametrize("call, error, match", [
    (lambda lm, x: lm(x, grop=None), TypeError,
     "LongNetLM.forward.. got an unexpected keyword argument 'grop'"),
    (lambda lm, x: lm.model.layers[0].attn(torch.randn(1, 16, 32, dtype=torch.float64),
                                            torch.arange(16), dist.group.WORLD), TypeError,
     r"cache must be a LayerKVCache or None, got ProcessGroup .*not an argument of "
     r"forward.*parallelize"),
    (lambda lm, x: lm(x, None, None, dist.group.WORLD), TypeError,
     "cache must be a KVCache or None, got ProcessGroup"),
])
def test_bad_or_positional_groups_are_named(group, call, error, match):
    with pytest.raises(error, match=match):
        call(make_lm(), torch.randint(0, 256, (1, 16)))


def test_a_kv_cache_under_sequence_parallelism_says_how_to_decode(group):
    model = make_lm().eval()
    parallelize(model, SequenceParallel(group))
    with pytest.raises(ValueError, match=r"KV cache cannot be combined with sequence "
                       r"parallelism.*parallelize\(model, None\)"):
        model(torch.randint(0, 256, (1, 4)), cache=model.new_cache())


def test_packed_documents_under_sequence_parallelism_need_positions(group):
    model = make_lm()
    parallelize(model, SequenceParallel(group))
    with pytest.raises(ValueError, match="LongNetModel: with document_ids under sequence "
                       "parallelism, pass position_ids"):
        model(torch.randint(0, 256, (1, 16)), document_ids=torch.zeros(1, 16, dtype=torch.long))


# ---------------------------------------------------------------- output_dropout
def test_attention_output_dropout_is_checked():
    assert MultiheadDilatedAttention(16, 2, [(8, 1)], output_dropout=0.25).output_dropout.p == 0.25
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropuot'"):
        MultiheadDilatedAttention(16, 2, [(8, 1)], dropuot=0.25)
    with pytest.raises(ValueError, match=r"output_dropout must be a number in \[0, 1\), got 2"):
        MultiheadDilatedAttention(16, 2, [(8, 1)], output_dropout=2)


# ---------------------------------------------------------------- the Lightning module
def test_the_lm_module_parallelizes_its_model_at_setup_and_releases_it_at_teardown(group):
    from types import SimpleNamespace

    from longnet.training import CausalLMModule
    from longnet.training.parallel.strategy import SequenceParallelLayout

    class Layout(SequenceParallelLayout):  # the strategy's side of the contract only
        sequence_parallel = SequenceParallel(group, "zigzag")

    module = CausalLMModule(config=dict(TINY, vocab_size=256))
    module._trainer = SimpleNamespace(strategy=Layout(), datamodule=None)
    module.setup("validate")
    assert all(m.sequence_parallel is Layout.sequence_parallel for m in readers(module.model))
    module.teardown("validate")
    assert all(m.sequence_parallel is None for m in readers(module.model))
    module._trainer = SimpleNamespace(strategy=object(), datamodule=None)  # not a layout
    module.setup("validate")
    assert all(m.sequence_parallel is None for m in readers(module.model))
