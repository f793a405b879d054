"""Unit tests of longnet.training: schedule, metrics, sharding, data order, module, builder."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from longnet.attention import DilatedPattern, padded_length
from longnet.modeling import LongNetLM
from longnet.training import (
    CausalLMModule,
    EpochIndexSampler,
    EpochLoader,
    ExportPretrained,
    PeakMemory,
    Rewarmup,
    TokenCrossEntropy,
    build_lm,
    lm_summary,
    parameter_groups,
)
from longnet.training import module as module_source
from longnet.training.metrics import sample_mean_loss
from longnet.training.parallel.batches import check_window_shards, shard_batch
from longnet.training.parallel.strategy import SequenceParallelStrategy
from longnet.training.schedule import WarmupCosine
from longnet.validation import UsageError

REPO = Path(__file__).resolve().parents[2]

TINY = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "max_positions": 64,
    "segment_lengths": [16, 32, 64],
    "dilation_rates": [1, 2, 4],
}


# ---------------------------------------------------------------------- optimizer, schedule
def test_warmup_cosine_shape():
    values = [WarmupCosine(4, 0.1, ((0, 14),))(step) for step in range(20)]
    assert values[0] == pytest.approx(1 / 5)
    assert values[3] == pytest.approx(4 / 5)
    assert values[4] == pytest.approx(1.0)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert values[14] == pytest.approx(0.1) and values[19] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


def test_parameter_groups_decay_matrices_once():
    model = build_lm("longnet-tiny", overrides=TINY | {"kv_conv_size": 4})  # tied embeddings
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    taps = {id(layer.attn.kv_conv.weight) for layer in model.model.layers}
    assert all(p.dim() >= 2 and id(p) not in taps for p in decay["params"])
    assert all(p.dim() < 2 or id(p) in taps for p in no_decay["params"])
    assert taps <= {id(p) for p in no_decay["params"]}
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})


def test_the_convolution_taps_get_their_own_learning_rate_on_the_same_schedule():
    """``kv_conv_learning_rate`` makes the taps a third AdamW group with that peak rate; the
    warmup and cosine scale it as they scale the others; without taps it is refused."""
    module = CausalLMModule(model="longnet-tiny", overrides=TINY | {"kv_conv_size": 4},
                            learning_rate=1e-3, kv_conv_learning_rate=5e-2, warmup_steps=2,
                            total_steps=10)
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    taps = {id(layer.attn.kv_conv.weight) for layer in module.model.model.layers}
    assert {id(p) for p in optimizer.param_groups[2]["params"]} == taps
    assert not taps & {id(p) for g in optimizer.param_groups[:2] for p in g["params"]}
    assert optimizer.param_groups[2]["weight_decay"] == 0.0
    for _ in range(4):  # warmup, then the cosine: every group at its peak times one factor
        rates = [g["lr"] for g in optimizer.param_groups]
        assert rates[2] / rates[0] == pytest.approx(50.0) and rates[0] == rates[1]
        optimizer.step()
        scheduler.step()
    default = CausalLMModule(model="longnet-tiny", overrides=TINY | {"kv_conv_size": 4},
                             learning_rate=1e-3, total_steps=10)
    groups = default.configure_optimizers()["optimizer"].param_groups
    assert [g["initial_lr"] for g in groups] == [1e-3, 1e-3]  # the taps among the vectors
    plain = CausalLMModule(model="longnet-tiny", overrides=TINY, kv_conv_learning_rate=5e-2,
                           total_steps=10)
    with pytest.raises(ValueError, match="kv_conv_learning_rate is set but the model has no "
                                         "trainable key/value convolution: set kv_conv_size"):
        plain.configure_optimizers()
    with pytest.raises(ValueError, match="kv_conv_learning_rate must be a finite positive"):
        CausalLMModule(model="longnet-tiny", overrides=TINY, kv_conv_learning_rate=0.0)


# ---------------------------------------------------------------------- metrics
def test_token_cross_entropy_is_token_weighted():
    metric = TokenCrossEntropy()
    metric.update(torch.tensor(10.0), torch.tensor(4))
    metric.update(torch.tensor(2.0), torch.tensor(1))
    result = metric.compute()
    assert result["loss"].item() == pytest.approx(12.0 / 5)  # not the mean of 2.5 and 2.0
    assert result["bpb"].item() == pytest.approx(12.0 / 5 / math.log(2))
    assert result["ppl"].item() == pytest.approx(math.exp(12.0 / 5))
    assert result["tokens"].item() == 5
    half = lm_summary(torch.tensor(2.0), torch.tensor(1), num_bytes=torch.tensor(2))
    assert half["bpb"].item() == pytest.approx(1 / math.log(2))
    assert lm_summary(torch.tensor(2.0), torch.tensor(1), bytes_per_token=2.0)["bpb"] == half["bpb"]
    counted = TokenCrossEntropy()
    counted.update(torch.tensor(10.0), torch.tensor(4), torch.tensor(12))
    counted.update(torch.tensor(2.0), torch.tensor(1))  # no count: one byte per token
    assert counted.compute()["bpb"].item() == pytest.approx(12.0 / 13 / math.log(2))


# ---------------------------------------------------------------------- sharding
def _batch(seq: int, batch: int = 2) -> dict:
    generator = torch.Generator().manual_seed(seq)
    return {
        "input_ids": torch.randint(0, 250, (batch, seq), generator=generator),
        "labels": torch.randint(0, 250, (batch, seq), generator=generator),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_concatenate_to_the_padded_sequence(world):
    pattern = DilatedPattern((32, 64, 128), (1, 2, 4))
    batch = _batch(120)
    shards = [shard_batch(batch, rank, world, pattern=pattern, pad_token_id=254)
              for rank in range(world)]
    inputs = torch.cat([s["input_ids"] for s in shards], dim=1)
    labels = torch.cat([s["labels"] for s in shards], dim=1)
    positions = torch.cat([s["position_ids"] for s in shards])
    length = inputs.shape[1]
    assert length >= 120 and length % world == 0
    assert len({s["input_ids"].shape for s in shards}) == 1
    assert torch.equal(inputs[:, :120], batch["input_ids"])
    assert torch.equal(labels[:, :120], batch["labels"])
    assert (inputs[:, 120:] == 254).all() and (labels[:, 120:] == -100).all()
    assert torch.equal(positions, torch.arange(length))


def test_shard_keeps_given_positions_and_refuses_bad_lengths():
    batch = _batch(8) | {"position_ids": torch.arange(100, 108)}
    shard = shard_batch(batch, 1, 2)
    assert torch.equal(shard["position_ids"], torch.arange(104, 108))
    with pytest.raises(ValueError, match="does not cut into the 3 equal stripes"):
        shard_batch(_batch(8), 0, 3)
    with pytest.raises(ValueError, match="6 equal stripes of the zigzag layout over 3 ranks"):
        shard_batch(_batch(9), 0, 3, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_batch(_batch(8), 0, 2, layout="striped")


def test_zigzag_shards_hold_an_early_and_a_late_chunk():
    batch = _batch(8) | {"position_ids": torch.arange(100, 108)}
    shards = [shard_batch(batch, rank, 2, layout="zigzag") for rank in range(2)]
    assert shards[0]["position_ids"].tolist() == [100, 101, 106, 107]
    assert shards[1]["position_ids"].tolist() == [102, 103, 104, 105]
    for shard in shards:  # every sequence entry is cut at the same places
        held = shard["position_ids"] - 100
        assert torch.equal(shard["input_ids"], batch["input_ids"][:, held])
        assert torch.equal(shard["labels"], batch["labels"][:, held])


def test_packed_documents_are_cut_with_their_global_positions_and_boundaries():
    """Positions restart at each document and the label whose target begins the next document
    is ignored, decided on the whole sequence (a document may cross the shard boundary); the
    padding continues the last document (exact for a causal model, as all padding here), so
    the last real label still counts."""
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [4, 4, 4, 4, 7, 7, 7, 7, 7, 7]])
    batch = _batch(10) | {"document_ids": ids}
    pattern = DilatedPattern((4,), (1,))
    shards = [shard_batch(batch, rank, 2, pattern=pattern, pad_token_id=254) for rank in range(2)]
    positions = torch.cat([shard["position_ids"] for shard in shards], dim=1)  # padded to 16
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                                  [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    documents = torch.cat([shard["document_ids"] for shard in shards], dim=1)
    assert documents[:, 10:].tolist() == [[1] * 6, [7] * 6]
    labels = torch.cat([shard["labels"] for shard in shards], dim=1)
    ignored = [(row, column) for row, column in (labels == -100).nonzero().tolist()
               if column < 10]  # the padded labels are ignored too
    assert ignored == [(0, 4), (1, 3)]  # the last label's target is data, not the padding
    assert (labels[:, 10:] == -100).all()
    with pytest.raises(ValueError, match="contiguous shards only.*load_balance: false"):
        shard_batch(batch, 0, 2, pattern=pattern, layout="zigzag")


def test_zigzag_pads_to_what_the_pattern_runs_on_in_2p_chunks():
    pattern = DilatedPattern((8, 16), (1, 2))
    batch = _batch(20)
    shards = [shard_batch(batch, rank, 2, pattern=pattern, pad_token_id=254, layout="zigzag")
              for rank in range(2)]
    length = padded_length(20, pattern, 4)  # 2P = 4 chunks, each a multiple of 8: 32
    assert length == 32
    positions = torch.cat([shard["position_ids"] for shard in shards]).sort().values
    assert torch.equal(positions, torch.arange(length))
    assert shards[1]["position_ids"].tolist() == [*range(8, 16), *range(16, 24)]
    late = shards[0]["input_ids"][:, 8:]  # chunk 3: positions 24..31, all padding
    assert (late == 254).all() and (shards[0]["labels"][:, 8:] == -100).all()
    with pytest.raises(KeyError, match="input_ids"):
        shard_batch({"labels": torch.zeros(1, 4)}, 0, 2)


def _shards_without_padding(length: int, pattern: DilatedPattern, chunks: int) -> bool:
    """Independent of padded_length: every branch's segment, capped at the window, divides
    the chunk or is a multiple of it."""
    if length % chunks:
        return False
    shard = length // chunks
    return all(shard % min(w, length) == 0 or min(w, length) % shard == 0
               for w in pattern.segment_lengths)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_windows_that_need_padding_are_refused_naming_the_nearest(world, layout):
    pattern = DilatedPattern((48, 96, 512), (1, 2, 4))
    chunks = world * (2 if layout == "zigzag" else 1)
    fitting = [n for n in range(1, 20_000) if _shards_without_padding(n, pattern, chunks)]
    for seq_len in range(1, 700):
        if seq_len in fitting:
            check_window_shards(seq_len, pattern, world, layout)
            continue
        with pytest.raises(UsageError, match=f"seq_len {seq_len} cannot be cut") as error:
            check_window_shards(seq_len, pattern, world, layout)
        options = [int(n) for n in str(error.value).rsplit("Use seq_len ", 1)[1][:-1].split(" or ")]
        below = [n for n in fitting if n < seq_len][-1:]
        above = next(n for n in fitting if n > seq_len)
        assert options == below + [above], seq_len
    check_window_shards(10, None, 2)
    with pytest.raises(UsageError, match="seq_len 9 cannot be cut into 2 equal"):
        check_window_shards(9, None, 2)
    check_window_shards(7, pattern, 1)


# ---------------------------------------------------------------------- data order
@pytest.mark.parametrize("size", [12, 13])
def test_replica_batches_union_is_the_single_device_batch(size):
    local_batch, replicas = 2, 3
    single = EpochIndexSampler(size, shuffle=True, seed=5)
    single.set_epoch(2)
    order = list(single)
    shards = []
    for rank in range(replicas):
        sampler = EpochIndexSampler(size, shuffle=True, seed=5, num_replicas=replicas, rank=rank)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    assert len({len(s) for s in shards}) == 1  # equal work per replica (wrap padding)
    for k in range(size // (local_batch * replicas)):
        union = sorted(i for s in shards for i in s[k * local_batch:(k + 1) * local_batch])
        assert union == sorted(order[k * local_batch * replicas:(k + 1) * local_batch * replicas])


def test_epoch_order_is_seeded_and_eval_split_is_exact():
    a = EpochIndexSampler(50, shuffle=True, seed=1)
    b = EpochIndexSampler(50, shuffle=True, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(50))
    shards = [list(EpochIndexSampler(7, shuffle=False, seed=0, num_replicas=3, rank=r, pad=False))
              for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))


def test_epoch_loader_resumes_after_consumed_batches():
    data = [{"x": torch.tensor(i)} for i in range(10)]
    base = DataLoader(data, batch_size=3, shuffle=True)
    consumed = {"n": 0}
    loader = EpochLoader(base, seed=3, consumed=lambda: consumed["n"])
    full = [b["x"].tolist() for b in loader]
    assert len(loader) == 4 and sorted(sum(full, [])) == list(range(10))
    consumed["n"] = 2
    state = loader.state_dict()
    assert state == {"seed": 3, "epoch": 0, "consumed": 2}
    resumed = EpochLoader(base, seed=99)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    assert [b["x"].tolist() for b in resumed] == full[2:]
    assert [b["x"].tolist() for b in resumed] == full  # the skip applies once
    resumed.load_state_dict({"seed": 3, "epoch": 0, "consumed": 4})  # epoch finished
    assert resumed.sampler.epoch == 1 and resumed.sampler.skip == 0


# ---------------------------------------------------------------------- builder, module
def test_build_lm_sources_and_errors(tmp_path):
    model = build_lm("longnet-tiny", overrides=TINY)
    assert isinstance(model, LongNetLM) and model.config.hidden_size == 32
    model.save_pretrained(tmp_path / "m")
    loaded = build_lm(pretrained=str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded.training
    from_config = build_lm(config=model.config.to_dict())
    assert from_config.config == model.config
    with pytest.raises(ValueError, match="exactly one of model"):
        build_lm()
    with pytest.raises(ValueError, match="exactly one of model"):
        build_lm("longnet-tiny", pretrained="longnet-tiny")
    with pytest.raises(FileNotFoundError, match="longnet-tiny"):
        build_lm("longnet-nope")
    with pytest.raises(ValueError, match="no field 'hiden_size'"):
        build_lm("longnet-tiny", overrides={"hiden_size": 8})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": 0.0}, "learning_rate must be positive"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"betas": (0.9, 1.5)}, "betas"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"total_steps": 0}, "total_steps"),
    ],
)
def test_module_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalLMModule(model="longnet-tiny", overrides=TINY, **kwargs)


def test_module_loss_is_the_token_mean_on_one_device():
    module = CausalLMModule(model="longnet-tiny", overrides=TINY)
    batch = _batch(64, batch=3)
    batch["labels"][0, 10:] = -100
    out = module(batch)
    assert out.loss.item() == pytest.approx(out.loss_sum.item() / out.num_tokens.item())
    assert module.pattern == DilatedPattern((16, 32, 64), (1, 2, 4))
    assert module.pad_token_id == 254
    assert module.sequence_parallel_group() is None


class Clock:
    """A stand-in for ``time.perf_counter``: one second a reading, and ``wait`` for the rest."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


def fit_timed(module: CausalLMModule, batches: list[dict], root: Path, monkeypatch,
              clock: Clock, callbacks: list[L.Callback] = ()) -> list[float]:
    """Fit ``module`` one step a batch with ``clock`` as the module's timer; the
    ``train/tokens_per_s`` it logged at every step."""
    logged = []
    monkeypatch.setattr(module_source, "time", SimpleNamespace(perf_counter=clock))

    class Rates(L.Callback):  # the module's hook runs after the callbacks': read it next step
        def on_train_batch_start(self, trainer, *args) -> None:
            if "train/tokens_per_s" in trainer.callback_metrics:
                logged.append(float(trainer.callback_metrics["train/tokens_per_s"]))

    trainer = L.Trainer(accelerator="cpu", max_steps=len(batches), logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=root,
                        callbacks=[*callbacks, Rates()])
    trainer.fit(module, DataLoader(batches, batch_size=None))
    logged.append(float(trainer.callback_metrics["train/tokens_per_s"]))
    return logged


def test_logged_throughput_times_the_step_not_the_callbacks_after_it(tmp_path, monkeypatch):
    """``train/tokens_per_s`` covers the forward, backward and optimizer step (three readings
    of the clock: two seconds), not the work callbacks do at the batch's end (a checkpoint
    saved: here 1,000 seconds), which runs before the module's own hook."""
    module = CausalLMModule(model="longnet-tiny", overrides=TINY)

    class SlowBatchEnd(L.Callback):
        def on_train_batch_end(self, *args) -> None:
            clock.wait(1000.0)

    clock = Clock()
    logged = fit_timed(module, [_batch(64) for _ in range(3)], tmp_path, monkeypatch, clock,
                       [SlowBatchEnd()])
    assert logged == [2 * 64 / 2] * 3


def test_logged_throughput_counts_the_input_tokens_not_the_scored_ones(tmp_path, monkeypatch):
    """A passkey example with recall labels scores a few of the tokens the step runs; the
    throughput counts the tokens run."""
    module = CausalLMModule(model="longnet-tiny", overrides=TINY)
    batch = _batch(64)
    batch["labels"][:, 3:] = -100  # 2 x 3 of the 2 x 64 tokens scored
    logged = fit_timed(module, [batch], tmp_path, monkeypatch, Clock())
    assert logged == [2 * 64 / 2]


def test_sample_loss_reduction_weighs_every_sample_equally():
    """Independent check: the mean over samples of each sample's own token-mean CE (labels
    with very different numbers of scored tokens), not the token mean."""
    torch.manual_seed(0)
    CausalLMModule(model="longnet-tiny", overrides=TINY, loss_reduction="sample")
    logits = torch.randn(3, 64, 256, dtype=torch.float64)
    labels = torch.randint(0, 256, (3, 64))
    labels[0, 5:] = -100          # 5 scored tokens
    labels[2, :] = -100           # no scored token: not counted as a sample
    expected = sum(
        torch.nn.functional.cross_entropy(logits[b][labels[b] != -100],
                                          labels[b][labels[b] != -100])
        for b in (0, 1)
    ) / 2
    loss = sample_mean_loss(logits, labels, world=1, group=None)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    token_mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - token_mean.item()) > 1e-3
    with pytest.raises(ValueError, match="loss_reduction"):
        CausalLMModule(model="longnet-tiny", overrides=TINY, loss_reduction="mean")


def test_strategy_and_module_contract():
    """SequenceParallelStrategy takes only a SequenceParallelModule (TypeError otherwise);
    the module finds a group only on that strategy, none under Lightning's own strategies."""
    import lightning as L

    from longnet.training.parallel.strategy import SequenceParallelModule

    class Plain(L.LightningModule):
        pass

    strategy = SequenceParallelStrategy(sequence_parallel_size=2)
    with pytest.raises(TypeError, match="Plain has no 'pattern' or 'pad_token_id'"):
        strategy.connect(Plain())
    module = CausalLMModule(model="longnet-tiny", overrides=TINY)
    assert isinstance(module, SequenceParallelModule)
    strategy.connect(module)
    assert strategy.lightning_module is module
    for name in ("auto", "ddp"):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        module.trainer = trainer
        assert module.sequence_parallel_group() is None


def test_strategy_refuses_bad_layouts_before_work():
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive integer"):
        SequenceParallelStrategy(sequence_parallel_size=0)
    strategy = SequenceParallelStrategy(sequence_parallel_size=3)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(UsageError, match="does not divide the 4 processes"):
        strategy.set_world_ranks()  # what the Trainer calls when it is built
    strategy = SequenceParallelStrategy(sequence_parallel_size=2)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert strategy.sequence_layout == "zigzag"  # load_balance by default
    assert SequenceParallelStrategy(2, load_balance=False).sequence_layout == "contiguous"
    assert SequenceParallelStrategy(1).sequence_layout == "contiguous"  # nothing to balance
    with pytest.raises(TypeError, match="load_balance must be True or False, got 'yes'"):
        SequenceParallelStrategy(sequence_parallel_size=2, load_balance="yes")


def test_sharded_strategy_refuses_bad_input_when_the_trainer_is_built():
    """World size not divisible by the group size, a precision Lightning refuses with
    ModelParallelStrategy (64-true), unknown mixed-precision dtypes, a module that does not
    name its network and blocks: errors before any process starts."""
    import lightning as L

    from longnet.training.parallel.fsdp import ShardedModule, ShardedSequenceParallelStrategy

    def trainer(devices: int, precision: str = "32-true", **kwargs) -> L.Trainer:
        strategy = ShardedSequenceParallelStrategy(**kwargs)
        return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                         precision=precision, logger=False)

    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the 3 "):
        trainer(3, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="does not support .*precision='64-true'"):
        trainer(4, precision="64-true", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        trainer(4, sequence_parallel_size=2, param_dtype="bf16")
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive integer"):
        ShardedSequenceParallelStrategy(sequence_parallel_size=0)
    strategy = trainer(4, sequence_parallel_size=2).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert (strategy.data_parallel_size, strategy.sequence_parallel_rank) == (2, 0)

    class PatternOnly(L.LightningModule):
        pattern = None
        pad_token_id = 0

    with pytest.raises(TypeError, match="PatternOnly has no 'network' or 'blocks'"):
        strategy.connect(PatternOnly())
    module = CausalLMModule(model="longnet-tiny", overrides=TINY)
    assert isinstance(module, ShardedModule)
    assert list(module.blocks) == list(module.model.model.layers)
    assert module.network is module.model


def test_last_checkpoint_finds_a_complete_file_or_folder(tmp_path):
    """A run resumes from last.ckpt when it is a file or a complete folder of shards (index
    and meta.pt), and starts fresh otherwise."""
    from longnet.training.checkpoint import last_checkpoint

    assert last_checkpoint(tmp_path / "missing") is None
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"")
    assert last_checkpoint(tmp_path) is None  # shards without an index: killed mid-save
    (folder / ".metadata").write_bytes(b"")
    assert last_checkpoint(tmp_path) is None  # no meta.pt yet
    (folder / "meta.pt").write_bytes(b"")
    assert last_checkpoint(tmp_path) == folder
    file_run = tmp_path / "file-run"
    file_run.mkdir()
    (file_run / "last.ckpt").write_bytes(b"")
    assert last_checkpoint(file_run) == file_run / "last.ckpt"


class Allocates(L.LightningModule):
    """One step that holds a ``mib``-MiB tensor alive while it computes its loss."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.mib = mib

    def training_step(self, batch, batch_idx):
        held = torch.ones(self.mib * 2**20 // 4)  # float32
        return (held.sum() * self.weight).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(range(1), batch_size=1)


def fit_allocating(mib: int, root: str) -> None:
    """One step of :class:`Allocates` with :class:`PeakMemory`, writing ``root/memory.json``."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=root, callbacks=[PeakMemory()])
    trainer.fit(Allocates(mib=mib))


def test_rank_memory_records_the_peak_a_step_adds(tmp_path):
    """In a process of its own: memory that earlier tests free during the fit would lower the
    resident size under the start and hide the step's 384 MiB."""
    script = ("from tests.unit.test_training import fit_allocating; "
              f"fit_allocating(384, {str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["device"] == "cpu" and memory["step"] == 1
    (rank,) = memory["ranks"]
    assert rank["rank"] == 0 and rank["start_mib"] > 0
    if memory["peak_since"] == "train start":  # the peak was reset: the 384 MiB tensor shows
        assert 256 <= rank["peak_above_start_mib"] < 384 + 128
    else:
        assert rank["peak_mib"] >= rank["start_mib"] + 256


@pytest.mark.parametrize("blocked", ["a file", "a file's child"])
def test_an_export_folder_that_cannot_be_written_stops_fit_before_a_step(tmp_path, blocked):
    file = tmp_path / "file"
    file.write_text("not a model folder")
    target = file if blocked == "a file" else file / "model"
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, callbacks=[ExportPretrained(str(target))])
    message = f"ExportPretrained dirpath {target}: {file} is a file, not a folder"
    with pytest.raises(UsageError, match=re.escape(message)):
        trainer.fit(Allocates(mib=1))
    assert trainer.global_step == 0 and file.read_text() == "not a model folder"


def test_rewarmup_ramps_from_the_resumed_step_only():
    ramp = Rewarmup(steps=3)
    assert [ramp.factor(step) for step in (0, 10)] == [1.0, 1.0]  # no fresh start seen
    ramp.load_state_dict({"start": 10})
    assert [ramp.factor(step) for step in (9, 10, 11, 12, 13)] == [1.0, 0.25, 0.5, 0.75, 1.0]
    assert ramp.state_dict() == {"start": 10}
    assert Rewarmup(steps=0).factor(0) == 1.0
    with pytest.raises(ValueError, match="steps must be a non-negative integer, got -1"):
        Rewarmup(steps=-1)
