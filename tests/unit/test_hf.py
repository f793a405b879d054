"""``longnet.hf``: the transformers Auto classes, generate with LongNet's KV cache, the byte
tokenizer, lm-eval. Random tiny models built here; nothing is downloaded."""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import re
import warnings
from pathlib import Path

import pytest
import torch

from longnet.cli import main
from longnet.data import ByteTokenizer
from longnet.modeling import (
    LongNetConfig,
    LongNetLM,
    NonFiniteWeightsError,
    WeightsMismatchError,
    list_models,
    resolve_model_dir,
    write_tokenizer_files,
)
from longnet.modeling.tokenizer_files import byte_characters, tokenizer_json

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    pipeline,
)

from longnet.hf import (  # noqa: E402
    LongNetCache,
    LongNetForCausalLM,
    LongNetHFConfig,
    byte_tokenizer,
    load_tokenizer,
)

F64 = torch.float64
PATTERN = dict(segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))


def make_lm(seed: int = 0, **overrides) -> LongNetLM:
    """A random byte-level LongNetLM (no EOS, so generation never stops early)."""
    config = dict(
        vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        max_positions=64, position_encoding="xpos", xpos_scale_base=16.0, sub_ln=True,
        initializer_range=0.3, **PATTERN,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return LongNetLM(LongNetConfig(**config)).eval()


def prompts(*lengths: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` padded on the left with 254 and the attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 254)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


# ---------------------------------------------------------------------- Auto classes, files
@pytest.mark.parametrize("tied", [True, False])
def test_auto_classes_load_a_save_pretrained_folder(tmp_path, tied):
    lm = make_lm(tie_word_embeddings=tied)
    lm.save_pretrained(tmp_path / "m")
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert isinstance(config, LongNetHFConfig) and config.to_longnet() == lm.config
    assert (config.num_hidden_layers, config.max_position_embeddings, config.use_cache) == (
        2, 64, True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert isinstance(model, LongNetForCausalLM) and model.dtype == torch.float32
    assert (model.longnet.lm_head.weight is model.longnet.model.embed_tokens.weight) == tied
    x = torch.stack(prompts(20, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, lm(x).logits, rtol=0, atol=1e-6)


def test_save_pretrained_writes_the_longnet_folder(tmp_path):
    config = LongNetHFConfig.from_longnet(make_lm(tie_word_embeddings=False).config)
    model = LongNetForCausalLM(config)  # a fresh LongNetLM inside
    model.save_pretrained(tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        "config.json", "model.safetensors", "README.md", "tokenizer.json",
        "tokenizer_config.json"}
    loaded = LongNetLM.from_pretrained(tmp_path / "m")
    assert loaded.config == model.longnet.config
    state = model.longnet.state_dict()
    assert all(torch.equal(t, state[name]) for name, t in loaded.state_dict().items())
    with pytest.raises(TypeError, match="max_shard_size"):
        model.save_pretrained(tmp_path / "x", max_shard_size="1MB")


def test_zoo_folder_loads_without_remote_code():
    folder = resolve_model_dir("longnet-tiny")
    model = AutoModelForCausalLM.from_pretrained(folder)
    by_name = LongNetForCausalLM.from_pretrained("longnet-tiny")
    lm = LongNetLM.from_pretrained("longnet-tiny")
    x = torch.tensor([ByteTokenizer().encode("def f(x):\n    return x + 1\n")])
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x).logits)
        assert torch.equal(by_name(x).logits, lm(x).logits)


LOADERS = [LongNetForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained]


@pytest.mark.parametrize("load", LOADERS, ids=["LongNetForCausalLM", "AutoModelForCausalLM"])
def test_a_folder_saved_again_while_loading_loads_one_version_whole(tmp_path, monkeypatch,
                                                                     load):
    """Another process saves a wider model into the folder as soon as its config.json has been
    read: the load is the old model or the new one (with the caller's changes), never the
    config of one with the weights of the other."""
    folder = tmp_path / "m"
    old, new = make_lm(), make_lm(seed=1, hidden_size=64)
    old.save_pretrained(folder)
    saved, build = [], LongNetHFConfig.__post_init__

    def build_then_save_new(self, **kwargs):
        build(self, **kwargs)
        if not saved:
            saved.append(new.save_pretrained(folder, overwrite=True))

    monkeypatch.setattr(LongNetHFConfig, "__post_init__", build_then_save_new)
    model = load(folder, use_cache=False, max_positions=128)
    assert saved and not model.config.use_cache
    expected = old if model.longnet.config.hidden_size == 32 else new
    assert model.longnet.config == dataclasses.replace(expected.config, max_positions=128)
    state = expected.state_dict()
    assert all(torch.equal(t, state[name]) for name, t in model.longnet.state_dict().items())


@pytest.mark.parametrize("load", LOADERS, ids=["LongNetForCausalLM", "AutoModelForCausalLM"])
def test_a_folder_loads_with_its_generation_config_and_name(tmp_path, load):
    make_lm().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    model = load(tmp_path)
    assert model.generation_config.max_new_tokens == 7
    assert model.name_or_path == model.config.name_or_path == str(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load(tmp_path)


def test_from_longnet_shares_the_module():
    lm = make_lm().double()
    model = LongNetForCausalLM.from_longnet(lm)
    assert model.longnet is lm and model.dtype == F64


# ---------------------------------------------------------------------- forward
def test_labels_follow_the_transformers_convention():
    lm = make_lm()
    model = LongNetForCausalLM.from_longnet(lm)
    x = torch.stack(prompts(12, 12))
    labels = x.clone()
    labels[0, 3] = -100
    with warnings.catch_warnings():  # labels equal to the inputs are the convention here
        warnings.filterwarnings("error", message=".*targets equal input_ids")
        model(x, labels=x, use_cache=False)  # no warning: the model shifts them
        out = model(x, labels=labels, use_cache=False)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.past_key_values is None


def test_left_padding_is_exact_and_other_padding_is_refused():
    lm = make_lm().double()
    model = LongNetForCausalLM.from_longnet(lm)
    rows = prompts(7, 11, 4)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            assert torch.equal(logits[i, pad:], lm(row[None]).logits[0])
            assert not logits[i, :pad].any()
        with pytest.raises(ValueError, match="left padding only"):
            model(ids, attention_mask=mask.flip(1))
        with pytest.raises(ValueError, match="no token"):
            model(ids, attention_mask=torch.zeros_like(mask))


def test_right_padding_without_a_mask_changes_nothing():
    """What lm-eval's loglikelihood does: rows of several lengths right-padded with 0."""
    lm = make_lm().double()
    model = LongNetForCausalLM.from_longnet(lm)
    rows = prompts(30, 7, 19)
    ids = torch.zeros(3, 30, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    with torch.no_grad():
        logits = model(ids).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(logits[i, :len(row)], lm(row[None]).logits[0],
                                       rtol=0, atol=1e-12)


def test_options_it_does_not_implement_are_refused():
    model = LongNetForCausalLM.from_longnet(make_lm())
    x = torch.stack(prompts(5))
    with pytest.raises(TypeError, match="output_attentions"):
        model(x, output_attentions=True)


# ---------------------------------------------------------------------- generate
@pytest.mark.parametrize(
    "overrides",
    [{}, {"position_encoding": "rope"},
     {"position_encoding": "learned", "sub_ln": False, "norm": "rmsnorm", "ffn_kind": "glu"}],
    ids=["xpos", "rope", "learned"],
)
def test_greedy_with_cache_equals_without_and_longnet_generate(overrides):
    lm = make_lm(**overrides).double()
    model = LongNetForCausalLM.from_longnet(lm)
    x = torch.stack(prompts(5, 5))
    steps = 45  # positions 5..49: crosses many segment boundaries of (4, 8, 16)
    cached = model.generate(x, max_new_tokens=steps, do_sample=False)
    uncached = model.generate(x, max_new_tokens=steps, do_sample=False, use_cache=False)
    assert cached.shape == (2, 5 + steps)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, lm.generate(x, steps, temperature=0))


def test_generate_replaces_transformers_cache_with_longnet_cache():
    model = LongNetForCausalLM.from_longnet(make_lm())
    x = torch.stack(prompts(6))
    out = model.generate(x, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, LongNetCache)
    assert out.past_key_values.get_seq_length() == 6 + 4  # the last token is not fed back


def test_beam_search_with_cache_equals_without():
    model = LongNetForCausalLM.from_longnet(make_lm().double())
    x = torch.stack(prompts(5, 5))
    kwargs = dict(max_new_tokens=30, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(model.generate(x, **kwargs), model.generate(x, use_cache=False, **kwargs))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_left_padded_generation_equals_each_prompt_alone(num_beams):
    model = LongNetForCausalLM.from_longnet(make_lm().double())
    rows = prompts(5, 9, 9, 3)
    ids, mask = left_padded(rows)
    kwargs = dict(max_new_tokens=20, num_beams=num_beams, do_sample=False)
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **kwargs)[0]
        assert torch.equal(batch[i, ids.shape[1] - len(row):], alone)


def test_sampling_with_a_seed_is_reproducible():
    model = LongNetForCausalLM.from_longnet(make_lm())
    x = torch.stack(prompts(5, 5))
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(123)
        runs.append(model.generate(x, max_new_tokens=25, do_sample=True, top_k=50,
                                   use_cache=use_cache))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


# ---------------------------------------------------------------------- tokenizer, pipeline
def _random_text(rng: random.Random, length: int) -> str:
    pools = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0xFF), (0x100, 0x7FF), (0x800, 0xD7FF),
             (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(length))


@pytest.mark.parametrize("source", ["folder", "memory"])
def test_tokenizer_encodes_and_decodes_as_byte_tokenizer(tmp_path, source):
    lm = make_lm(eos_token_id=255, pad_token_id=254)
    lm.save_pretrained(tmp_path)
    tokenizer = (AutoTokenizer.from_pretrained(tmp_path) if source == "folder"
                 else byte_tokenizer(lm.config))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (255, 254)
    ours = ByteTokenizer()
    rng = random.Random(0)
    texts = ["", "héllo wörld 😀\n\ttabs  spaces ", "ÿþ are bytes 255/254 only in ids",
             *(_random_text(rng, rng.randint(1, 60)) for _ in range(200))]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text)
        assert tokenizer.decode(ids) == text
    for _ in range(300):  # arbitrary bytes, valid UTF-8 or not
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
        ids = list(data)
        assert tokenizer.decode(ids) == ours.decode(ids)
        assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(ids)) == ids
    assert tokenizer.decode([104, 105, 255, 254], skip_special_tokens=True) == "hi"
    assert ours.encode("a\ud800b") == list(b"a?b")
    with pytest.raises(TypeError):  # lone surrogates: the tokenizers library refuses them
        tokenizer("a\ud800b")


def test_tokenizer_json_is_what_the_tokenizers_library_builds():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {character: byte for byte, character in enumerate(byte_characters())}
    built = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    built.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    built.decoder = decoders.ByteLevel()
    assert json.loads(built.to_str()) == tokenizer_json()
    assert sorted(byte_characters()) == sorted(pre_tokenizers.ByteLevel.alphabet())


def test_every_byte_level_zoo_folder_ships_the_tokenizer(tmp_path):
    """(An entry of another vocabulary gets its own tokenizer when it is imported:
    test_import_pretrained.py.)"""
    for name in list_models():
        if LongNetConfig.from_pretrained(name).vocab_size != 256:
            continue
        (tmp_path / name).mkdir()
        written = write_tokenizer_files(tmp_path / name, LongNetConfig.from_pretrained(name))
        assert len(written) == 2
        for path in written:  # up to date: `python -m longnet.modeling.zoo` rewrites them
            assert (resolve_model_dir(name) / path.name).read_text() == path.read_text()
        tokenizer = load_tokenizer(name)
        assert tokenizer("passkey 71432")["input_ids"] == list(b"passkey 71432")


def test_pipeline_text_generation_runs(tmp_path):
    lm = make_lm()
    lm.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(tmp_path),
                         tokenizer=AutoTokenizer.from_pretrained(tmp_path))
    prompt = "def main():"
    text = generator(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    expected = lm.generate(torch.tensor([list(prompt.encode())]), 12, temperature=0)[0]
    assert text == ByteTokenizer().decode(expected)


# ---------------------------------------------------------------------- bad input
def test_a_foreign_config_is_refused_with_what_to_do(tmp_path):
    gpt2 = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' model, not a LongNet model.*LongNetLM"):
        LongNetForCausalLM.from_pretrained(tmp_path)


def test_a_missing_tokenizer_file_says_how_to_write_it(tmp_path):
    make_lm().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*write_tokenizer_files"):
        load_tokenizer(tmp_path)


def test_auto_tokenizer_on_a_folder_without_tokenizer_files_says_how_to_write_them(tmp_path):
    make_lm().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer_config.json"
                       ".*write_tokenizer_files"):
        AutoTokenizer.from_pretrained(tmp_path)


def _run_folder(root: Path) -> Path:
    """A training run's folder: its ``save_pretrained`` export in ``model/``, a checkpoint."""
    make_lm().save_pretrained(root / "run" / "model")
    (root / "run" / "checkpoints").mkdir()
    (root / "run" / "checkpoints" / "last.ckpt").write_bytes(b"not read")
    return root / "run"


LONGNET_LOADERS = [LongNetHFConfig.from_pretrained, LongNetForCausalLM.from_pretrained,
                   load_tokenizer, LongNetLM.from_pretrained]


@pytest.mark.parametrize("load", LONGNET_LOADERS,
                         ids=["LongNetHFConfig", "LongNetForCausalLM", "load_tokenizer",
                              "LongNetLM"])
def test_a_run_folder_or_a_ckpt_names_what_to_load_instead(tmp_path, load):
    run = _run_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"{run} has no config.json; it is a training "
                       rf"run's folder: load {run / 'model'}"):
        load(run)
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(FileNotFoundError, match=rf"{ckpt} is a file, not a model folder; .*"
                       rf"longnet export {ckpt} OUTPUT"):
        load(ckpt)


def test_longnet_hf_config_reads_a_zoo_name_and_its_folder(tmp_path):
    assert LongNetHFConfig.from_pretrained("longnet-tiny").to_longnet() == (
        LongNetLM.from_pretrained("longnet-tiny").config)
    config = LongNetHFConfig.from_pretrained(_run_folder(tmp_path), subfolder="model")
    assert config.to_longnet() == make_lm().config


@pytest.mark.parametrize("call", [
    lambda model: model(torch.tensor([[1, 2]]), use_cache="no"),
    lambda model: LongNetHFConfig.from_longnet(model.longnet.config, use_cache="no"),
    lambda model: model(torch.tensor([[1, 2]]), return_dict="no"),
])
def test_hf_flags_must_be_bools(call):
    with pytest.raises(TypeError, match="(use_cache|return_dict) must be True or False, got 'no'"):
        call(LongNetForCausalLM.from_longnet(make_lm()))


def test_missing_weights_are_an_error_not_a_random_init(tmp_path):
    from safetensors.torch import load_file, save_file

    make_lm().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.final_norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsMismatchError, match="missing keys: longnet.model.final_norm"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "random", "nan"])
def test_damaged_or_non_finite_weights_are_refused_naming_the_file(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    make_lm().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    if damage == "nan":
        tensors = load_file(path)
        tensors["model.final_norm.weight"][3] = float("nan")
        save_file(tensors, path)
        error, message = NonFiniteWeightsError, "NaN or infinite weights: model.final_norm.weight"
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncate"
                         else random.Random(0).randbytes(len(data)))
        error, message = ValueError, "not a readable safetensors file.*corrupt or truncated"
    with pytest.raises(error, match=f"{re.escape(str(path))} .*{message}"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_prompt_beyond_learned_positions_says_what_to_do():
    model = LongNetForCausalLM.from_longnet(make_lm(position_encoding="learned"))
    x = torch.stack(prompts(70))
    with pytest.raises(ValueError, match="positions 0..63.*shorten the input"):
        model.generate(x, max_new_tokens=2, do_sample=False)


# ---------------------------------------------------------------------- lm-eval
def _harness(tmp_path, model_dir, *args: str) -> list[dict[str, str]]:
    """``longnet eval harness`` on ``model_dir``; its CSV rows."""
    pytest.importorskip("lm_eval")
    out = tmp_path / "out"
    assert main(["eval", "harness", "--models", str(model_dir), "--out", str(out), *args]) == 0
    assert json.loads((out / "run.json").read_text())["models"] == {"tiny": str(model_dir)}
    with (out / "harness.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_harness_bits_per_byte_equals_eval_perplexity_at_batch_size_4(tmp_path):
    make_lm(eos_token_id=255, pad_token_id=254).save_pretrained(tmp_path / "tiny")
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = random.Random(0)
    # Lengths that are multiples of the context give lm-eval's rolling windows exactly the
    # sliding windows of longnet eval perplexity (longnet.hf.harness docstring); the 5-byte
    # document makes lm-eval right-pad its batches of 4.
    for n in (48, 5, 32, 64, 16):
        (docs / f"d{n}.txt").write_text("".join(rng.choice("abcdef ghij\n") for _ in range(n)))
    rows = _harness(tmp_path, tmp_path / "tiny", "--tasks", "bpb", "--data-files",
                    str(docs / "*.txt"), "--split", "all", "--context-length", "16",
                    "--batch-size", "4", "--compare", "--no-progress")
    value = {(r["task"], r["metric"]): float(r["value"]) for r in rows}
    assert {r["examples"] for r in rows} == {"5"} and {r["length"] for r in rows} == {"16"}
    assert value[("longnet_bpb", "bits_per_byte")] == pytest.approx(
        value[("eval_perplexity", "scored_bits_per_byte")], abs=1e-6)


@pytest.mark.slow
def test_harness_runs_ruler_niah_offline(tmp_path):
    make_lm(eos_token_id=255, pad_token_id=254).save_pretrained(tmp_path / "tiny")
    rows = _harness(tmp_path, tmp_path / "tiny", "--tasks", "niah_single_1",
                    "--niah-lengths", "1K", "--niah-examples", "2", "--batch-size", "2")
    assert [(r["task"], r["length"], r["examples"]) for r in rows] == [
        ("niah_single_1", "1024", "2")]
    assert 0 <= float(rows[0]["value"]) <= 1
