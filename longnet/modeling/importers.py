"""Import local Hugging Face GPT-2 and Llama-family checkpoints as LongNet models.

Read without ``transformers`` (no unpickling of objects). With the default dense pattern the
model computes the original's function. Llama's split-half RoPE is LongNet's layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longnet.modeling.config import LongNetConfig
from longnet.modeling.serialization import read_safetensors
from longnet.nn.rope_extension import check_rope_extension

# Hugging Face activation names -> LongNet's.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of a Hugging Face checkpoint folder (CPU), never unpickling objects."""
    single = folder / "model.safetensors"
    if single.is_file():
        return read_safetensors(single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(_weight_map(index).values())):
            tensors.update(read_safetensors(folder / shard))
        return tensors
    binary = folder / "pytorch_model.bin"
    bin_index = folder / "pytorch_model.bin.index.json"
    if binary.is_file() or bin_index.is_file():
        shards = (
            [binary]
            if binary.is_file()
            else [folder / s for s in sorted(set(_weight_map(bin_index).values()))]
        )
        tensors = {}
        for shard in shards:
            try:
                loaded = torch.load(shard, map_location="cpu", weights_only=True)
            except Exception as err:  # any unpickling failure
                raise ValueError(
                    f"{shard} could not be read as a weights-only PyTorch file ({err}); it is "
                    "corrupt or contains arbitrary Python objects, which are refused."
                ) from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{shard} does not hold a state dict.")
            tensors.update(loaded)
        return tensors
    raise FileNotFoundError(
        f"no weights in {folder}: looked for model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin and pytorch_model.bin.index.json."
    )


def _weight_map(index: Path) -> dict[str, str]:
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a valid shard index ({err}).") from None


def _require(hf: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in hf:
        raise ValueError(f"{model_type} config.json lacks {key!r}; it is not a complete config.")
    return hf[key]


def _activation(name: str, model_type: str) -> str:
    try:
        return HF_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"{model_type} checkpoint uses activation {name!r}, which LongNet does not "
            f"implement; supported: {sorted(HF_ACTIVATIONS)}."
        ) from None


def _token_id(value: Any, vocab_size: int) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and 0 <= value < vocab_size else None


def _strip(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()}


def _rename(
    tensors: dict[str, Tensor],
    rule: Callable[[str, Tensor], list[tuple[str, Tensor]] | None],
    source: str,
) -> dict[str, Tensor]:
    """Apply ``rule`` to every tensor; an unknown name raises, naming it."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        mapped = rule(name, tensor)
        if mapped is None:
            raise ValueError(
                f"{source}: tensor {name!r} has no LongNet counterpart; the checkpoint has parts "
                "this importer does not know (a different architecture variant?)."
            )
        out.update(mapped)
    return out


# ---------------------------------------------------------------------- GPT-2
def _gpt2(hf: dict[str, Any], tensors: dict[str, Tensor], source: str):
    mt = "gpt2"
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError(f"{source}: scale_attn_by_inverse_layer_idx=True is not supported.")
    if not hf.get("scale_attn_weights", True):
        raise ValueError(f"{source}: scale_attn_weights=False is not supported.")
    if hf.get("add_cross_attention", False):
        raise ValueError(f"{source}: GPT-2 with cross-attention is not supported.")
    hidden = _require(hf, "n_embd", mt)
    vocab = _require(hf, "vocab_size", mt)
    tensors = _strip(tensors, "transformer.")
    tie = bool(hf.get("tie_word_embeddings", True)) or "lm_head.weight" not in tensors
    config = LongNetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=_require(hf, "n_layer", mt),
        num_heads=_require(hf, "n_head", mt),
        ffn_kind="mlp",
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        activation=_activation(hf.get("activation_function", "gelu_new"), mt),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=tie,
        max_positions=_require(hf, "n_positions", mt),
        position_encoding="learned",
        bos_token_id=_token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=_token_id(hf.get("eos_token_id"), vocab),
        pad_token_id=_token_id(hf.get("pad_token_id"), vocab),
        extra={"imported_from": "gpt2"},
    )

    def rule(name: str, t: Tensor) -> list[tuple[str, Tensor]] | None:
        fixed = {
            "wte.weight": "model.embed_tokens.weight",
            "wpe.weight": "model.embed_positions.weight",
            "ln_f.weight": "model.final_norm.weight",
            "ln_f.bias": "model.final_norm.bias",
        }
        if name in fixed:
            return [(fixed[name], t)]
        if name == "lm_head.weight":
            return [] if tie else [("lm_head.weight", t)]
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "h":
            return None
        layer, rest = f"model.layers.{parts[1]}", ".".join(parts[2:])
        if rest in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers of old checkpoints
            return []
        if rest.startswith("attn.c_attn."):
            pieces = (t.t() if rest.endswith("weight") else t).chunk(3, dim=0)
            kind = rest.rsplit(".", 1)[1]
            return [
                (f"{layer}.attn.{p}_proj.{kind}", piece.contiguous())
                for p, piece in zip("qkv", pieces)
            ]
        targets = {
            "ln_1": "attn_norm",
            "ln_2": "ffn_norm",
            "attn.c_proj": "attn.out_proj",
            "mlp.c_fc": "ffn.up_proj",
            "mlp.c_proj": "ffn.down_proj",
        }
        module, kind = rest.rsplit(".", 1)
        if module not in targets:
            return None
        conv1d = module != "ln_1" and module != "ln_2"
        value = t.t().contiguous() if conv1d and kind == "weight" else t
        return [(f"{layer}.{targets[module]}.{kind}", value)]

    return config, _rename(tensors, rule, source)


# ---------------------------------------------------------------------- Llama family
def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and RoPE extension of a Llama config, filled in as ``transformers`` does."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None)
    params.pop("type", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial rotary embeddings (partial_rotary_factor < 1) are "
                         "not supported.")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "yarn":
        original = hf.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        params.setdefault("original_max_position_embeddings", original)
        if params.get("factor") is None and original:
            params["factor"] = hf.get("max_position_embeddings") / original
    try:
        return theta, check_rope_extension({"rope_type": rope_type, **params})
    except ValueError as err:
        raise ValueError(f"{source}: RoPE scaling: {err}") from None


def _llama(hf: dict[str, Any], tensors: dict[str, Tensor], source: str):
    mt = hf.get("model_type", "llama")
    window = hf.get("sliding_window")
    max_positions = _require(hf, "max_position_embeddings", mt)
    if window is not None and window < max_positions:
        raise ValueError(
            f"{source}: sliding-window attention (window {window}) is not a dilated pattern; "
            "only checkpoints without a sliding window are supported."
        )
    hidden = _require(hf, "hidden_size", mt)
    heads = _require(hf, "num_attention_heads", mt)
    vocab = _require(hf, "vocab_size", mt)
    tensors = _strip(tensors, "model.")
    tie = bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors
    head_dim = hf.get("head_dim") or hidden // heads
    theta, extension = _rope(hf, source)
    config = LongNetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=_require(hf, "num_hidden_layers", mt),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=None if head_dim * heads == hidden else head_dim,
        ffn_kind="glu",
        ffn_hidden_size=_require(hf, "intermediate_size", mt),
        activation=_activation(hf.get("hidden_act", "silu"), mt),
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=tie,
        max_positions=max_positions,
        position_encoding="rope",
        rope_theta=theta,
        rope_extension=extension,
        bos_token_id=_token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=_token_id(hf.get("eos_token_id"), vocab),
        pad_token_id=_token_id(hf.get("pad_token_id"), vocab),
        extra={"imported_from": mt},
    )
    targets = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn.q_proj",
        "self_attn.k_proj": "attn.k_proj",
        "self_attn.v_proj": "attn.v_proj",
        "self_attn.o_proj": "attn.out_proj",
        "mlp.gate_proj": "ffn.gate_proj",
        "mlp.up_proj": "ffn.up_proj",
        "mlp.down_proj": "ffn.down_proj",
    }

    def rule(name: str, t: Tensor) -> list[tuple[str, Tensor]] | None:
        if name == "embed_tokens.weight":
            return [("model.embed_tokens.weight", t)]
        if name == "norm.weight":
            return [("model.final_norm.weight", t)]
        if name == "lm_head.weight":
            return [] if tie else [("lm_head.weight", t)]
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "layers":
            return None
        module, kind = ".".join(parts[2:]).rsplit(".", 1)
        if module == "self_attn.rotary_emb":  # inv_freq buffer of old checkpoints
            return []
        if module not in targets:
            return None
        return [(f"model.layers.{parts[1]}.{targets[module]}.{kind}", t)]

    return config, _rename(tensors, rule, source)


IMPORTERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _llama}


def is_hf_config(data: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a foreign (Hugging Face) one."""
    return data.get("model_type") not in (None, "longnet")


def import_hf_checkpoint(
    folder: str | Path, data: dict[str, Any] | None = None, **overrides: Any
) -> tuple[LongNetConfig, dict[str, Tensor]]:
    """The LongNet config and state dict of a local Hugging Face checkpoint folder."""
    folder = Path(folder)
    if data is None:
        data = json.loads((folder / "config.json").read_text())
    return convert_hf_checkpoint(
        data, lambda: read_hf_weights(folder), f"Hugging Face checkpoint {folder}", **overrides
    )


def convert_hf_checkpoint(
    data: dict[str, Any],
    tensors: dict[str, Tensor] | Callable[[], dict[str, Tensor]],
    source: str,
    **overrides: Any,
) -> tuple[LongNetConfig, dict[str, Tensor]]:
    """The LongNet config and state dict of a Hugging Face config and ``tensors`` (or a reader)."""
    model_type = data.get("model_type")
    if model_type not in IMPORTERS:
        raise ValueError(
            f"{source}: cannot import model_type {model_type!r}; supported: "
            f"{', '.join(sorted(IMPORTERS))} (or a LongNet folder with model_type 'longnet')."
        )
    config, tensors = IMPORTERS[model_type](
        data, tensors() if callable(tensors) else tensors, source
    )
    if overrides:
        config = config.replace(**overrides)
    return config, tensors
