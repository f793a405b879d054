"""The byte-level vocabulary as Hugging Face tokenizer files, written next to every model.

Plain JSON, so that ``AutoTokenizer.from_pretrained(folder)`` encodes exactly as
``longnet.data.ByteTokenizer`` (id = byte value) without the core needing ``transformers``:
BPE over GPT-2's 256 byte characters with no merges; the config's special ids, never produced
from text (``split_special_tokens``); invalid UTF-8 decoded to U+FFFD; left padding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longnet.files import write_atomic
from longnet.modeling.config import LongNetConfig

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
BYTE_VOCAB_SIZE = 256
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                  "pad_token": "pad_token_id"}
"""``tokenizer_config.json`` keys and the config fields that give their ids."""


def byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet: ``byte_characters()[b]`` is the token of byte ``b``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    characters: list[str] = []
    others = 0
    for byte in range(BYTE_VOCAB_SIZE):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(BYTE_VOCAB_SIZE + others))
            others += 1
    return characters


def is_byte_level(config: LongNetConfig) -> bool:
    """Whether the model reads bytes (``vocab_size == 256``)."""
    return config.vocab_size == BYTE_VOCAB_SIZE


def tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` of the byte-level vocabulary (module docstring)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        # The library's default ByteLevel decoder: decoding only maps characters back to bytes.
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {character: byte for byte, character in enumerate(byte_characters())},
            "merges": [],
        },
    }


def tokenizer_config(config: LongNetConfig) -> dict[str, Any]:
    """The ``tokenizer_config.json`` for a byte-level ``config``: its special tokens.

    Raises:
        ValueError: ``config`` is not byte-level (``vocab_size != 256``).
    """
    if not is_byte_level(config):
        raise ValueError(
            f"the byte tokenizer has {BYTE_VOCAB_SIZE} ids but this model has vocab_size "
            f"{config.vocab_size}; a model of another vocabulary needs its own tokenizer."
        )
    characters = byte_characters()
    special = {key: characters[getattr(config, field)] for key, field in SPECIAL_TOKENS.items()
               if getattr(config, field) is not None}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "model_input_names": ["input_ids", "attention_mask"],
    }


def write_tokenizer_files(directory: str | Path, config: LongNetConfig) -> list[Path]:
    """Write the tokenizer files into ``directory`` if ``config`` is byte-level; returns them."""
    if not is_byte_level(config):
        return []
    directory = Path(directory)
    return [
        write_atomic(directory / name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        for name, data in ((TOKENIZER_NAME, tokenizer_json()),
                           (TOKENIZER_CONFIG_NAME, tokenizer_config(config)))
    ]
