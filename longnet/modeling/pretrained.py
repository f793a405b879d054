"""``save_pretrained`` / ``from_pretrained`` and model cards; model classes are found by name
in :data:`ARCHITECTURES` (``longnet.modeling.model`` imports this module, not the reverse)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from longnet.files import (
    check_path_given,
    check_target,
    open_files,
    replace_folder,
    write_atomic,
)
from longnet.modeling.config import CONFIG_NAME, MODEL_TYPE, LongNetConfig, check_saved_fields
from longnet.modeling.hub import (
    WEIGHTS_FROM,
    external_weights_hint,
    folder_config,
    materialized_dir,
    resolve_model_dir,
)
from longnet.modeling.importers import import_hf_checkpoint, is_hf_config
from longnet.modeling.serialization import (
    REWRITE_FIX,
    WEIGHTS_NAME,
    load_state_checked,
    parse_safetensors,
    save_weights,
)
from longnet.modeling.tokenizer_files import (
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    is_byte_level,
    write_tokenizer_files,
)

CARD_NAME = "README.md"
SAVED_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, TOKENIZER_NAME, TOKENIZER_CONFIG_NAME)
"""The files :func:`save_pretrained` writes (the tokenizer files for byte-level models only)."""
MODEL_SOURCE = "model name or folder"
"""What :func:`from_pretrained` calls its ``name_or_dir`` in messages."""

ARCHITECTURES: dict[str, type[nn.Module]] = {}
"""Model classes by name; every ``LongNetPreTrained`` subclass adds itself (first one kept)."""


def count_parameters(config: LongNetConfig, architecture: str = "LongNetLM") -> int:
    """Exact parameter count of a model built from ``config`` (on the meta device)."""
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ValueError(
            f"unknown architecture {architecture!r}; known: {', '.join(sorted(ARCHITECTURES))}."
        )
    with torch.device("meta"):
        model = cls(config)
    return model.num_parameters()


def model_card(
    config: LongNetConfig,
    name: str,
    *,
    architecture: str = "LongNetLM",
    has_weights: bool,
    description: str = "",
    details: str = "",
    num_parameters: int | None = None,
) -> str:
    """A Markdown card: size, shape, pattern, context, weights, then ``details``."""
    params = count_parameters(config, architecture) if num_parameters is None else num_parameters
    pattern = config.pattern
    branches = ", ".join(f"({w}, {r})" for w, r in pattern.branches)
    dense = config.segment_lengths is None
    norm = f"pre-LN {config.norm}" + (" + sub-LN (MAGNETO)" if config.sub_ln else "")
    ffn = f"{config.ffn_kind} ({config.activation}), inner width {config.resolved_ffn_hidden_size}"
    kv = (
        f", {config.resolved_num_kv_heads} K/V heads"
        if config.resolved_num_kv_heads != config.num_heads
        else ""
    )
    external = config.extra.get(WEIGHTS_FROM)
    weights = (
        f"`{WEIGHTS_NAME}` in this folder."
        if has_weights
        else f"not in this folder: {external_weights_hint(name, external)}"
        if external
        else "**No weights exist yet**: this folder holds the configuration only. Build an "
        f'untrained model with `{architecture}(LongNetConfig.from_pretrained("{name}"))`.'
    )
    lines = [
        f"# {name}",
        "",
        description or f"A LongNet model (`{architecture}`).",
        "",
        "| | |",
        "|---|---|",
        f"| Parameters | {params:,} ({params / 1e6:.2f} M, computed from `config.json`) |",
        f"| Architecture | `{architecture}`, {config.num_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_heads} heads of {config.resolved_head_dim}{kv} |",
        f"| Attention pattern | {'dense: ' if dense else ''}(segment length, dilation rate) = "
        f"{branches} |",
        *(
            [f"| K/V convolution | causal, depthwise, width {config.kv_conv_size} |"]
            if config.kv_conv_size
            else []
        ),
        *(
            ["| Retrieval branches | "
             + f"{config.neighbor_segments} neighbour segment(s), " * bool(config.neighbor_segments)
             + f"{config.attention_sinks} sinks, top {config.select_top_k} blocks of "
             f"{config.select_block}, positions {config.retrieval_positions} |"]
            if config.retrieval is not None
            else []
        ),
        f"| Context length | {config.max_positions:,} tokens |",
        f"| Position encoding | {config.position_encoding} |",
        f"| Norm | {norm}, eps {config.norm_eps} |",
        f"| Feed-forward | {ffn} |",
        f"| Vocabulary | {config.vocab_size} |",
        f"| Tied embeddings | {config.tie_word_embeddings} |",
        "",
        f"Weights: {weights}",
        "",
        "```python",
        *(
            [f"from longnet.modeling import {architecture}",
             f'model = {architecture}.from_pretrained("{name}")']
            if has_weights or external
            else ["from longnet.modeling import LongNetConfig, " + architecture,
                  f'config = LongNetConfig.from_pretrained("{name}")']
        ),
        "```",
        "",
    ]
    card = "\n".join(lines)
    return f"{card}\n{details.strip()}\n" if details.strip() else card


def save_pretrained(model: nn.Module, directory: str | Path, name: str | None = None, *,
                    overwrite: bool = False) -> Path:
    """Write config, weights, card and byte-level tokenizer into ``directory`` in one step;
    other files are kept (an old tokenizer too when the vocabulary size matches)."""
    check_target(directory, overwrite=overwrite, what="save_pretrained directory")
    architecture = type(model).__name__
    data = {"architecture": architecture, **model.config.to_dict()}
    card = model_card(
        model.config, name or Path(directory).name, architecture=architecture, has_weights=True,
        num_parameters=model.num_parameters(),
    )
    owned = SAVED_FILES
    vocab_size = model.config.vocab_size
    if not is_byte_level(model.config) and folder_config(directory).get("vocab_size") == vocab_size:
        owned = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
    with replace_folder(directory, owned, "save_pretrained directory") as folder:
        (folder / CONFIG_NAME).write_text(json.dumps(data, indent=2) + "\n")
        save_weights(model, folder / WEIGHTS_NAME)
        (folder / CARD_NAME).write_text(card)
        write_tokenizer_files(folder, model.config)
    return Path(directory)


def read_config_json(files: dict[str, BinaryIO], folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` (LongNet or Hugging Face) among the open ``files``."""
    config_path = folder / CONFIG_NAME
    if CONFIG_NAME not in files:
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}.")
    try:
        data = json.loads(files[CONFIG_NAME].read())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} must hold a JSON object.")
    return data


def pretrained_config(name_or_dir: str | Path, **overrides: Any) -> LongNetConfig:
    """The config :func:`from_pretrained` would build its model from."""
    check_path_given(name_or_dir, MODEL_SOURCE)
    folder = resolve_model_dir(name_or_dir)
    with open_files(folder, (CONFIG_NAME,)) as files:
        data = read_config_json(files, folder)
    if is_hf_config(data):
        return import_hf_checkpoint(folder, data, **overrides)[0]
    check_saved_fields(data, folder / CONFIG_NAME)
    return LongNetConfig.from_dict(data, **overrides)


def from_pretrained(
    cls: type, name_or_dir: str | Path, *, dtype: torch.dtype | str | None = None,
    **overrides: Any,
):
    """See :meth:`longnet.modeling.LongNetLM.from_pretrained`."""
    dtype = parameter_dtype(dtype)
    check_path_given(name_or_dir, MODEL_SOURCE)
    folder = resolve_model_dir(name_or_dir)
    with open_files(folder, (CONFIG_NAME, WEIGHTS_NAME)) as files:
        data = read_config_json(files, folder)
        if is_hf_config(data):
            config, tensors = import_hf_checkpoint(folder, data, **overrides)
            source = f"Hugging Face checkpoint {folder}"
        else:
            config = _longnet_config(cls, data, folder, overrides)
            external = config.extra.get(WEIGHTS_FROM)
            if WEIGHTS_NAME not in files and external:
                raise FileNotFoundError(f"{folder} holds no {WEIGHTS_NAME}: "
                                        f"{external_weights_hint(folder.name, external)}")
            if WEIGHTS_NAME not in files:
                raise FileNotFoundError(
                    f"{folder} has a config but no {WEIGHTS_NAME} (no trained weights yet). "
                    f"Build an untrained model with {cls.__name__}(LongNetConfig."
                    f"from_pretrained({str(name_or_dir)!r}))."
                )
            source = str(folder / WEIGHTS_NAME)
            tensors = _read_weights(files[WEIGHTS_NAME].read(), folder)
    model = cls(config)
    if dtype is not None:
        model = model.to(dtype)
    if config.kv_conv_size and not any(name.endswith(".kv_conv.weight") for name in tensors):
        # K/V convolution added by an override: its identity init keeps the saved function
        tensors = {
            **{n: t for n, t in model.state_dict().items() if n.endswith(".kv_conv.weight")},
            **tensors,
        }
    load_state_checked(model, tensors, source=source)
    return model.eval()


def _read_weights(data: bytes, folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``folder``'s weights file, whose bytes are ``data``.

    Raises:
        ValueError: a damaged file; for a user-cache entry the message says to import it again.
    """
    cached = Path(os.path.realpath(folder)) == Path(os.path.realpath(
        materialized_dir(folder.name)))
    fix = (f"It is the cached import of {folder.name} (cut short by a copy, a full disk or a "
           f"kill): to import it again, delete {folder} and load {folder.name!r} again, or run "
           f"longnet import {folder.name} "
           f"(longnet.hf.materialize({folder.name!r}, force=True)).") if cached else REWRITE_FIX
    return parse_safetensors(data, folder / WEIGHTS_NAME, fix)


def parameter_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``from_pretrained``'s ``dtype``: a floating ``torch.dtype``, its name, or None.

    Raises:
        ValueError: anything else, naming it.
    """
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    resolved = getattr(torch, name, None) if name else dtype
    if dtype is None or (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        return resolved
    raise ValueError(
        f"dtype must be a floating torch.dtype or its name (torch.float32, 'bfloat16', "
        f"'float16', ...), got {dtype!r}."
    )


def _longnet_config(
    cls: type, data: dict[str, Any], folder: Path, overrides: dict[str, Any]
) -> LongNetConfig:
    """The config in ``data``, refusing one saved by another architecture than ``cls``."""
    architecture = data.get("architecture", cls.__name__)
    if data.get("model_type", MODEL_TYPE) == MODEL_TYPE and architecture != cls.__name__:
        raise ValueError(
            f"{folder} holds a {architecture}; load it with {architecture}.from_pretrained "
            f"(or build a fresh {cls.__name__} from LongNetConfig.from_pretrained)."
        )
    check_saved_fields(data, folder / CONFIG_NAME)
    return LongNetConfig.from_dict(data, **overrides)


def write_model_folder(
    directory: str | Path,
    config: LongNetConfig,
    *,
    architecture: str = "LongNetLM",
    description: str = "",
    has_weights: bool = False,
    details: str = "",
) -> Path:
    """Write a zoo entry's ``config.json``, card and byte-level tokenizer files (no weights)."""
    directory = Path(directory)
    data = {"architecture": architecture, **config.to_dict()}
    write_atomic(directory / CONFIG_NAME, json.dumps(data, indent=2) + "\n")
    card = model_card(
        config,
        directory.name,
        architecture=architecture,
        has_weights=has_weights,
        description=description,
        details=details,
    )
    write_atomic(directory / CARD_NAME, card)
    write_tokenizer_files(directory, config)
    return directory
