"""RoPE context extension (linear position interpolation, YaRN) equals ``transformers``'.

The reference is ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (frequencies and
attention factor) and a tiny random Llama with that ``rope_parameters`` (logits, float64, with
the float32 casts of its RMSNorm and RoPE removed as in ``test_import_hf.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from longnet.modeling import LongNetConfig, LongNetLM
from longnet.nn import RotaryEmbedding
from tests.unit.test_import_hf import (  # noqa: F401 (a fixture)
    _llama,
    _llama_without_float32_casts,
    _tokens,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

F64 = torch.float64
EXTENSIONS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "linear", "factor": 1.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.25},
]


@pytest.mark.parametrize("extension", EXTENSIONS, ids=lambda e: json.dumps(e))
@pytest.mark.parametrize(("head_dim", "theta"), [(64, 1e5), (32, 500.0), (128, 5e5)])
def test_frequencies_equal_transformers(extension, head_dim, theta):
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=int(extension["factor"] * extension.get(
            "original_max_position_embeddings", 1024)),
        rope_parameters={"rope_theta": theta, **extension},
    )
    reference, factor = ROPE_INIT_FUNCTIONS[extension["rope_type"]](config, torch.device("cpu"))
    rope = RotaryEmbedding(head_dim, theta, extension)
    ours, our_factor = rope.frequencies(torch.device("cpu"))
    assert torch.equal(ours, reference)  # the same float32 operations: bit-identical
    assert our_factor == pytest.approx(factor, abs=1e-15)
    positions = torch.tensor([0, 1, 7, 1000, 8191, 65535, 10**6])
    cos, sin = rope.cos_sin(positions)
    angles = positions.to(F64)[:, None] * reference.to(F64)
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos, angles.cos() * factor, rtol=0, atol=1e-10)
    torch.testing.assert_close(sin, angles.sin() * factor, rtol=0, atol=1e-10)


@pytest.mark.parametrize("extension", [EXTENSIONS[0], EXTENSIONS[3], EXTENSIONS[4]],
                         ids=lambda e: e["rope_type"])
def test_imported_llama_with_rope_scaling_matches(tmp_path, extension,
                                                  _llama_without_float32_casts):  # noqa: F811
    rope = {"rope_theta": 500.0, **extension}
    if extension["rope_type"] == "yarn":
        rope["original_max_position_embeddings"] = 16
    hf = _llama(tmp_path, rope_parameters=rope, max_position_embeddings=64)
    ours = LongNetLM.from_pretrained(tmp_path, dtype=F64)
    assert ours.config.rope_extension["rope_type"] == extension["rope_type"]
    x = _tokens(2, 64)
    with torch.no_grad():
        ref = hf.double()(x).logits
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours(x).logits, ref, rtol=0, atol=1e-10)
    saved = LongNetLM.from_pretrained(ours.save_pretrained(tmp_path / "saved"), dtype=F64)
    assert saved.config.rope_extension == ours.config.rope_extension


def test_legacy_rope_scaling_key_is_imported(tmp_path):
    _llama(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("rope_parameters", None)
    data["rope_theta"] = 500.0
    data["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = LongNetLM.from_pretrained(tmp_path).config
    assert config.rope_theta == 500.0
    assert config.rope_extension == {"rope_type": "linear", "factor": 2.0}


def test_unknown_or_bad_extension_is_refused(tmp_path):
    _llama(tmp_path, rope_parameters={"rope_theta": 500.0, "rope_type": "dynamic",
                                      "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported; supported: "
                                         "linear, yarn"):
        LongNetLM.from_pretrained(tmp_path)
    base = LongNetConfig(position_encoding="rope")
    with pytest.raises(ValueError, match="yarn needs 'original_max_position_embeddings'"):
        base.replace(rope_extension={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="needs 'factor'"):
        base.replace(rope_extension={"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"\['beta'\] are not among them"):
        base.replace(rope_extension={"rope_type": "linear", "factor": 2.0, "beta": 1})
    with pytest.raises(ValueError, match="factor'\\] must be a finite positive number"):
        base.replace(rope_extension={"rope_type": "linear", "factor": -1})
    with pytest.raises(ValueError, match="extends RoPE only"):
        LongNetConfig(position_encoding="xpos",
                      rope_extension={"rope_type": "linear", "factor": 2.0})


def test_config_round_trip_fills_yarn_defaults(tmp_path):
    config = LongNetConfig(position_encoding="rope", rope_extension={
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024})
    assert config.rope_extension == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
        "mscale_all_dim": None, "truncate": True,
    }
    config.save(tmp_path)
    assert LongNetConfig.load(tmp_path) == config


def test_frequencies_are_built_once_per_setting(monkeypatch):
    """Every layer and step reads the same frequencies: built on the first call of a setting
    (device, theta, extension) and kept; a changed theta (a length curriculum's stage) or
    extension builds its own, equal to a fresh module's."""
    import longnet.nn.positional as positional

    built = []
    real = positional.extended_frequencies
    monkeypatch.setattr(positional, "extended_frequencies",
                        lambda *args: built.append(args[2]) or real(*args))
    extension = EXTENSIONS[2]
    rope = RotaryEmbedding(64, 1e5, extension)
    positions = torch.arange(16)
    first = rope.cos_sin(positions)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(rope.cos_sin(positions), first))
    assert built == [1e5]
    rope.theta = 5e5
    changed = rope.cos_sin(positions)
    fresh = RotaryEmbedding(64, 5e5, extension).cos_sin(positions)
    assert all(torch.equal(a, b) for a, b in zip(changed, fresh))
    rope.extension = {**rope.extension, "factor": 8.0}
    rope.cos_sin(positions)
    assert built == [1e5, 5e5, 5e5, 5e5]  # theta changed, the fresh module, the new extension
