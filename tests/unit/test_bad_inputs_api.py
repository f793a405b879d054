"""Bad inputs of the Python API found by ``lab/bad_inputs/api.yaml``: each is refused by
longnet's own checks with a message naming the value, or (NumPy numbers, dtype names) just
works. Tiny random models; nothing is downloaded."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from longnet.attention import dilated_attention
from longnet.modeling import LongNetConfig, LongNetLM, WeightsMismatchError
from longnet.nn import MultiheadDilatedAttention
from longnet.validation import UsageError

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


def make_lm(**overrides) -> LongNetLM:
    torch.manual_seed(0)
    return LongNetLM(LongNetConfig(**TINY, **overrides)).eval()


# ---------------------------------------------------------------- attention
def test_numpy_float_scale_is_a_float():
    q, k, v = torch.randn(3, 1, 16, 2, 8).unbind(0)
    got = dilated_attention(q, k, v, [(8, 1)], scale=np.float32(0.25))
    assert torch.equal(got, dilated_attention(q, k, v, [(8, 1)], scale=0.25))


def test_a_pattern_string_is_refused_naming_it():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(TypeError, match=r"pairs such as .*got str '8,1'"):
        dilated_attention(q, q, q, "8,1")


@pytest.mark.parametrize("x, error, match", [
    (torch.randn(2, 16, 16), ValueError, r"embed_dim 32, got \(2, 16, 16\)"),
    (torch.randn(16, 32), ValueError, r"\(batch, seq, embed_dim\).*got \(16, 32\)"),
    (torch.randn(2, 16, 32, dtype=torch.float64), TypeError, r"float64.*float32"),
])
def test_attention_layer_refuses_an_input_it_cannot_take(x, error, match):
    layer = MultiheadDilatedAttention(32, 4, [(8, 1)])
    with pytest.raises(error, match=match):
        layer(x)


def test_attention_layer_takes_another_dtype_under_autocast():
    layer = MultiheadDilatedAttention(32, 4, [(8, 1)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 16, 32, dtype=torch.bfloat16))
    assert out.shape == (2, 16, 32) and out.isfinite().all()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_heads=0), ValueError, "num_heads must be a positive integer, got 0"),
    (dict(embed_dim=32.0), ValueError, "embed_dim must be a positive integer, got 32.0"),
    (dict(causal="no"), TypeError, "causal must be True or False, got 'no'"),
    (dict(output_dropout=1.5), ValueError, r"output_dropout must be a number in \[0, 1\), got 1.5"),
    (dict(head_dim=0), ValueError, "head_dim must be a positive integer, got 0"),
])
def test_attention_layer_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiheadDilatedAttention(**{"embed_dim": 32, "num_heads": 4, "pattern": [(8, 1)],
                                     **kwargs})


def test_attention_layer_takes_numpy_sizes():
    layer = MultiheadDilatedAttention(np.int64(32), np.int64(4), [(8, 1)],
                                      num_kv_heads=np.int64(2))
    assert (layer.embed_dim, layer.num_kv_heads) == (32, 2)
    assert type(layer.embed_dim) is int and layer(torch.randn(1, 8, 32)).shape == (1, 8, 32)


# ---------------------------------------------------------------- config
def test_config_takes_numpy_floats_and_writes_them_as_json():
    config = LongNetConfig(**TINY, dropout=np.float32(0.25), rope_theta=np.float64(5e4),
                           norm_eps=np.float32(1e-5))
    assert type(config.dropout) is float and config.dropout == 0.25
    again = LongNetConfig.from_dict(json.loads(config.to_json_string()))
    assert again == config


def test_config_save_creates_the_folder_and_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "new" / "config.json"
    LongNetConfig(**TINY).save(path)
    assert LongNetConfig.load(path).hidden_size == 32

    def fail(handle):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        LongNetConfig(**{**TINY, "hidden_size": 64}).save(path)
    assert LongNetConfig.load(path).hidden_size == 32  # the old file, whole
    assert os.listdir(path.parent) == ["config.json"]  # no temporary file left


# ---------------------------------------------------------------- LongNetLM
def test_targets_that_are_not_a_tensor_are_refused():
    with pytest.raises(TypeError, match="targets must be a torch.Tensor, got list"):
        make_lm()(torch.tensor([[1, 2, 3]]), targets=[[2, 3, 4]])


@pytest.mark.parametrize("eos", [256, -1, 3.0])
def test_generate_refuses_an_eos_id_outside_the_vocabulary(eos):
    with pytest.raises(ValueError, match=rf"eos_token_id .* 0\.\.255, got {eos}"):
        make_lm().generate(torch.tensor([[1, 2]]), 4, eos_token_id=eos)


def test_from_pretrained_takes_a_dtype_name_and_refuses_other_dtypes(tmp_path):
    make_lm().save_pretrained(tmp_path / "m")
    for name in ("bfloat16", "torch.bfloat16"):
        model = LongNetLM.from_pretrained(tmp_path / "m", dtype=name)
        assert next(model.parameters()).dtype == torch.bfloat16
    for bad in (torch.int8, "auto", "bfloat"):
        with pytest.raises(ValueError, match=f"dtype must be a floating.*got {bad!r}"):
            LongNetLM.from_pretrained(tmp_path / "m", dtype=bad)


# ---------------------------------------------------------------- longnet.hf
hf = pytest.importorskip("transformers")


def _edit_config(folder, **changes) -> None:
    data = json.loads((folder / "config.json").read_text())
    for name, value in changes.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    (folder / "config.json").write_text(json.dumps(data))


def test_hf_refuses_weights_of_another_shape_naming_them(tmp_path):
    from longnet.hf import LongNetForCausalLM

    make_lm().save_pretrained(tmp_path / "m")
    _edit_config(tmp_path / "m", hidden_size=64)
    with pytest.raises(WeightsMismatchError, match=r"m/model.safetensors does not match .*"
                       r"embed_tokens.weight \(checkpoint \(256, 32\), model \(256, 64\)\)"):
        LongNetForCausalLM.from_pretrained(tmp_path / "m")


def test_hf_refuses_a_longnet_config_json_that_omits_the_pattern(tmp_path):
    from longnet.hf import LongNetForCausalLM

    make_lm(segment_lengths=(16, 64), dilation_rates=(1, 2)).save_pretrained(tmp_path / "m")
    _edit_config(tmp_path / "m", segment_lengths=None, dilation_rates=None)
    with pytest.raises(UsageError, match="omits segment_lengths, dilation_rates"):
        LongNetForCausalLM.from_pretrained(tmp_path / "m")


def test_hf_loads_a_config_json_transformers_wrote_without_its_defaults(tmp_path):
    from longnet.hf import LongNetForCausalLM, LongNetHFConfig

    lm = make_lm(segment_lengths=(16, 64), dilation_rates=(1, 2))
    lm.save_pretrained(tmp_path / "m")
    LongNetHFConfig.from_longnet(lm.config).save_pretrained(tmp_path / "m")
    # transformers leaves out the fields at PreTrainedConfig's defaults (num_labels 2)
    assert "num_labels" not in json.loads((tmp_path / "m" / "config.json").read_text())
    model = LongNetForCausalLM.from_pretrained(tmp_path / "m")
    assert model.longnet.config.pattern == lm.config.pattern


def test_hf_names_a_missing_folder(tmp_path, monkeypatch):
    from longnet.hf import LongNetForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = str(tmp_path / "runs" / "modle")
    with pytest.raises(FileNotFoundError, match=f"{missing!r} is neither a model folder"):
        LongNetForCausalLM.from_pretrained(missing)
