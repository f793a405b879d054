"""The byte-level vocabulary as Hugging Face tokenizer files, written next to every model.

A model with ``vocab_size == 256`` reads bytes: token id = byte value, the vocabulary of
``longnet.data.ByteTokenizer``. :func:`write_tokenizer_files` writes that vocabulary as
``tokenizer.json`` (the ``tokenizers`` library's format) and ``tokenizer_config.json`` (what
``transformers.AutoTokenizer`` reads), so ``AutoTokenizer.from_pretrained(folder)`` encodes
exactly as ``ByteTokenizer``. The files are plain JSON written here, so the core needs
neither ``tokenizers`` nor ``transformers``; ``tests/unit/test_hf.py`` checks that the
``tokenizers`` library builds the same ``tokenizer.json``.

The tokenizer:

- **Model**: BPE over 256 one-byte tokens and no merges, after the byte-level
  pre-tokenizer (GPT-2's map of each byte to a printable character, no regex split, no
  prefix space). Every text is encoded as its UTF-8 bytes, one token per byte, whatever it
  contains (spaces, newlines, any script, emoji). Token ``b`` is the character GPT-2's table
  gives byte ``b`` (``"Ġ"`` for the space), so ``convert_ids_to_tokens`` and
  ``convert_tokens_to_ids`` map all 256 ids both ways.
- **Special tokens**: ``eos_token`` and ``pad_token`` (and ``bos_token`` when the config sets
  one) are the tokens of the config's ids (for the zoo: 255 and 254, bytes that UTF-8 never
  produces). ``split_special_tokens`` is on, so text is never matched against special
  tokens: the text "ÿ" is its two UTF-8 bytes, never the EOS id. ``tokenizer.json`` itself
  lists no added tokens, so the plain ``tokenizers`` library also encodes pure bytes.
- **Decoding** joins the bytes and decodes them as UTF-8 with U+FFFD for invalid sequences
  (the same replacements as Python's ``errors="replace"``, which ``ByteTokenizer.decode``
  uses); EOS/PAD decode to U+FFFD unless ``skip_special_tokens=True`` drops them.
- **Not text**: a ``str`` holding lone surrogates (not encodable as UTF-8) is refused by the
  ``tokenizers`` library, where ``ByteTokenizer`` writes ``"?"``. Arbitrary bytes, valid UTF-8
  or not, need no tokenizer: their ids are the byte values, ``list(data)``.
- ``padding_side`` is ``"left"`` (what batched generation needs), and
  ``clean_up_tokenization_spaces`` is off (decoding never edits spaces).
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
    """GPT-2's byte-level alphabet: ``byte_characters()[b]`` is the token of byte ``b``.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, DEL,
    NBSP, soft hyphen) map in order to ``chr(256)``, ``chr(257)``, ...
    """
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
    """Whether the model reads bytes (``vocab_size == 256``), so the byte tokenizer fits it."""
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
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` when
    ``config`` is byte-level, each whole or not at all (:func:`longnet.files.write_atomic`);
    returns the files written (none for other vocabularies)."""
    if not is_byte_level(config):
        return []
    directory = Path(directory)
    return [
        write_atomic(directory / name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        for name, data in ((TOKENIZER_NAME, tokenizer_json()),
                           (TOKENIZER_CONFIG_NAME, tokenizer_config(config)))
    ]
