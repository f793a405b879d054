"""``attn_implementation="longnet_dilated"`` in ``transformers``' own Llama (float64).

With one dense branch it equals ``sdpa`` (logits and every gradient); with a dilated pattern it
equals ``LongNetLM`` with the same weights imported (logits, gradients, and greedy generation with
``transformers``' KV cache across many segment boundaries). The float32 casts of
``transformers``' RMSNorm and RoPE are removed for the comparisons with ``LongNetLM``, which
computes those in float64 (as in ``test_import_hf.py``).
"""

from __future__ import annotations

import pytest
import torch

from longnet.attention import Retrieval
from longnet.modeling import LongNetLM
from tests.unit.test_import_hf import (  # noqa: F401 (a fixture)
    _llama,
    _llama_without_float32_casts,
    _tokens,
)

transformers = pytest.importorskip("transformers")
from longnet.hf import use_dilated_attention  # noqa: E402
from longnet.hf.attention import ATTENTION_NAME  # noqa: E402

F64 = torch.float64
PATTERN = [(8, 1), (16, 2), (32, 4)]


def _load(folder, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=F64, **kwargs).eval()


def test_one_dense_branch_equals_sdpa_outputs_and_gradients(tmp_path):
    _llama(tmp_path, max_position_embeddings=128)
    sdpa = _load(tmp_path, attn_implementation="sdpa")
    ours = use_dilated_attention(_load(tmp_path), [(128, 1)])
    assert ours.config._attn_implementation == ATTENTION_NAME
    x = _tokens(2, 100)
    losses = [model(x, labels=x).loss for model in (sdpa, ours)]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-12)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(sdpa.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-10, msg=name)


def test_pattern_equals_longnet_lm_with_the_same_weights(tmp_path, _llama_without_float32_casts):  # noqa: F811
    _llama(tmp_path, max_position_embeddings=128)
    lm = LongNetLM.from_pretrained(tmp_path, dtype=F64, pattern=PATTERN)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.longnet_pattern = [list(b) for b in PATTERN]
    hf = _load(tmp_path, config=config, attn_implementation=ATTENTION_NAME)
    sdpa = _load(tmp_path, attn_implementation="sdpa")
    x = _tokens(2, 90)  # segments of 32 cut it at 32 and 64; the last is shorter
    expected = lm(x).logits
    logits = hf(x).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    with torch.no_grad():
        assert (sdpa(x).logits - expected).abs().max() > 1e-2  # the pattern does change it
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (expected * upstream).sum().backward()
    (logits * upstream).sum().backward()
    ours = dict(lm.named_parameters())
    names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "out_proj"}
    for layer in range(2):
        for theirs, own in names.items():
            a = ours[f"model.layers.{layer}.attn.{own}.weight"].grad
            b = hf.model.layers[layer].self_attn.get_submodule(theirs).weight.grad
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    torch.testing.assert_close(hf.model.embed_tokens.weight.grad,
                               ours["model.embed_tokens.weight"].grad, rtol=0, atol=1e-10)
    hf.save_pretrained(tmp_path / "saved")  # the pattern is saved with the model
    again = _load(tmp_path / "saved", attn_implementation=ATTENTION_NAME)
    assert again.config.longnet_pattern == [list(b) for b in PATTERN]


def test_kv_cache_generation_equals_longnet_lm(tmp_path, _llama_without_float32_casts):  # noqa: F811
    _llama(tmp_path, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    lm = LongNetLM.from_pretrained(tmp_path, dtype=F64, pattern=PATTERN)
    hf = use_dilated_attention(_load(tmp_path), PATTERN)
    prompt = _tokens(1, 13)
    expected = lm.generate(prompt, 64, temperature=0)  # 77 tokens: many segment boundaries
    generated = hf.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected)
    # Prefill then one-token steps against the cache give the full forward's logits.
    x = expected
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        steps = [hf(x[:, :20], cache=cache, use_cache=True).logits]
        steps += [hf(x[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(20, 77)]
        torch.testing.assert_close(torch.cat(steps, dim=1), hf(x).logits, rtol=0, atol=1e-10)


def test_what_it_cannot_run_is_refused(tmp_path):
    _llama(tmp_path)
    x = _tokens(2, 20)
    with pytest.raises(ValueError, match="needs the dilated pattern in the model config"):
        _load(tmp_path, attn_implementation=ATTENTION_NAME)(x)
    model = use_dilated_attention(_load(tmp_path), PATTERN)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="runs unpadded rows only"):
        model(x, attention_mask=mask)
    with pytest.raises(ValueError, match="packed sequences and other positions are refused"):
        model(x, position_ids=torch.arange(20).repeat(2, 1) + 5)
    with pytest.raises(ValueError, match="StaticCache: use the default DynamicCache"):
        model.generate(x[:1], max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    for layer in model.model.layers:  # what the config's attention_dropout sets
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="set the config's attention_dropout to 0"):
        model.train()(x)
    with pytest.raises(ValueError, match="dilation"):
        use_dilated_attention(model, [(8, 0)])


def test_retrieval_branches_equal_longnet_lm_and_decode_with_the_cache(
        tmp_path, _llama_without_float32_casts):  # noqa: F811
    """Neighbours, sinks and block selection in transformers' Llama: logits equal LongNetLM's
    with the same weights and branches, cached one-token steps equal the full forward, and the
    branches are saved with the model."""
    _llama(tmp_path, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    retrieval = Retrieval(sinks=2, block=4, top_k=2, neighbors=1)
    lm = LongNetLM.from_pretrained(tmp_path, dtype=F64, pattern=PATTERN, attention_sinks=2,
                                   select_block=4, select_top_k=2, neighbor_segments=1)
    hf = use_dilated_attention(_load(tmp_path), PATTERN, retrieval)
    x = _tokens(1, 77)
    with torch.no_grad():
        expected = lm(x).logits
        torch.testing.assert_close(hf(x).logits, expected, rtol=0, atol=1e-10)
        plain = use_dilated_attention(_load(tmp_path), PATTERN)(x).logits
        assert (plain - expected).abs().max() > 1e-3  # the branches do change it
        cache = transformers.DynamicCache(config=hf.config)
        steps = [hf(x[:, :20], cache=cache, use_cache=True).logits]
        steps += [hf(x[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(20, 77)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=0, atol=1e-10)
    hf.save_pretrained(tmp_path / "saved")
    again = _load(tmp_path / "saved", attn_implementation=ATTENTION_NAME)
    assert again.config.longnet_retrieval == {"sinks": 2, "block": 4, "top_k": 2,
                                              "neighbors": 1}
    again.config.longnet_retrieval = {"sinks": 2, "blocks": 4}
    with pytest.raises(ValueError, match="longnet_retrieval"):
        again(x)
