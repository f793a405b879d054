"""Importing local Hugging Face GPT-2 / Llama checkpoints: the logits equal the original's.

The reference models are tiny random ``transformers`` models built offline from a config.
Their weights are re-drawn with a larger spread than the default init so the logits are
O(1) and every parameter matters.

Float64 and Llama: ``transformers``' Llama computes RMSNorm and the RoPE angles in float32
even in a float64 model (explicit ``.to(torch.float32)`` casts), so its float64 logits are
only float32-accurate.  The 1e-10 comparison therefore runs against the same Hugging Face
model with exactly those two casts removed (``_llama_without_float32_casts``: the same
formulas in the input dtype); the unmodified model is compared at float32 accuracy.
"""

from __future__ import annotations

import json

import pytest
import torch

from longnet.attention import DilatedPattern
from longnet.modeling import LongNetLM, WeightsMismatchError, import_hf_checkpoint

transformers = pytest.importorskip("transformers")

F64 = torch.float64
VOCAB = 61


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            is_norm = p.dim() == 1 and ("ln" in name or "norm" in name) and "weight" in name
            p.copy_(1.0 + 0.2 * noise if is_norm else 0.2 * noise)


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


def _gpt2(tmp_path, **overrides):
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=48,
        n_embd=24,
        n_layer=2,
        n_head=3,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    _randomize(model, 1)
    model.save_pretrained(tmp_path)
    return model


def _llama(tmp_path, **overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model, 2)
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture
def _llama_without_float32_casts(monkeypatch):
    from transformers.models.llama import modeling_llama

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        inv_freq = self.inv_freq.to(device=x.device, dtype=F64)
        freqs = position_ids[..., None].to(F64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.attention_scaling
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)


def _compare(hf, folder, x, tol32=1e-4, tol64=1e-10):
    ours = LongNetLM.from_pretrained(folder)
    with torch.no_grad():
        ref = hf.float()(x).logits
        assert ref.abs().max() > 1.0  # O(1) logits: the comparison is meaningful
        torch.testing.assert_close(ours(x).logits, ref, rtol=0, atol=tol32)
        ours64 = LongNetLM.from_pretrained(folder, dtype=F64)
        torch.testing.assert_close(ours64(x).logits, hf.double()(x).logits, rtol=0, atol=tol64)
    return ours


def test_gpt2_logits_match(tmp_path):
    hf = _gpt2(tmp_path)
    ours = _compare(hf, tmp_path, _tokens(2, 48))
    c = ours.config
    assert (c.position_encoding, c.norm, c.activation, c.ffn_kind) == (
        "learned",
        "layernorm",
        "gelu_tanh",
        "mlp",
    )
    assert c.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert c.pattern == DilatedPattern.dense(48)


def test_gpt2_from_pytorch_model_bin(tmp_path):
    hf = _gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    _compare(hf, tmp_path, _tokens(1, 30))


def test_llama_with_grouped_heads_logits_match(tmp_path, _llama_without_float32_casts):
    hf = _llama(tmp_path)
    ours = _compare(hf, tmp_path, _tokens(2, 64))
    c = ours.config
    assert (c.position_encoding, c.norm, c.ffn_kind, c.activation) == (
        "rope",
        "rmsnorm",
        "glu",
        "silu",
    )
    assert (c.num_kv_heads, c.rope_theta, c.tie_word_embeddings) == (2, 500.0, False)


def test_llama_variant_tied_biased_wide_heads(tmp_path, _llama_without_float32_casts):
    hf = _llama(
        tmp_path,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=12,
        num_key_value_heads=1,
    )
    ours = _compare(hf, tmp_path, _tokens(2, 40))
    assert ours.config.resolved_head_dim == 12
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_unmodified_llama_matches_to_float32_accuracy_in_float64(tmp_path):
    hf = _llama(tmp_path).double()
    ours = LongNetLM.from_pretrained(tmp_path, dtype=F64)
    x = _tokens(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, rtol=0, atol=1e-4)


def test_sharded_safetensors_checkpoint(tmp_path, _llama_without_float32_casts):
    hf = _llama(tmp_path / "full")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _compare(hf, tmp_path / "sharded", _tokens(1, 20))


def test_dilated_pattern_override_is_kept(tmp_path):
    _llama(tmp_path / "hf")
    pattern = [(8, 1), (16, 2), (32, 4)]
    model = LongNetLM.from_pretrained(tmp_path / "hf", pattern=pattern)
    dense = LongNetLM.from_pretrained(tmp_path / "hf")
    assert model.config.pattern == DilatedPattern.coerce(pattern)
    x = _tokens(1, 40)
    with torch.no_grad():
        logits = model(x).logits
        assert torch.isfinite(logits).all()
        # the first 8 positions: the (8, 1) branch gives every key, the others only some:
        # the model is no longer the dense one
        assert not torch.allclose(logits, dense(x).logits)
    model.save_pretrained(tmp_path / "longnet")
    again = LongNetLM.from_pretrained(tmp_path / "longnet")
    assert again.config.pattern == model.config.pattern
    assert torch.equal(again(x).logits, logits)


def test_import_errors(tmp_path):
    _gpt2(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match="cannot import model_type 'bert'"):
        LongNetLM.from_pretrained(tmp_path / "bert")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="no weights"):
        import_hf_checkpoint(tmp_path / "empty")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "gpt2" / "model.safetensors")
    tensors["transformer.h.0.attn.rotary.weight"] = torch.zeros(3)
    save_file(tensors, tmp_path / "gpt2" / "model.safetensors")
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.rotary\.weight|rotary"):
        LongNetLM.from_pretrained(tmp_path / "gpt2")
    del tensors["transformer.h.0.attn.rotary.weight"]
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, tmp_path / "gpt2" / "model.safetensors")
    with pytest.raises(WeightsMismatchError, match=r"model\.layers\.1\.ffn\.up_proj\.bias"):
        LongNetLM.from_pretrained(tmp_path / "gpt2")
