"""The byte tokenizer as a ``transformers`` tokenizer: from a model folder, or in memory.

Both come from the JSON of :mod:`longnet.modeling.tokenizer_files` (ids = byte values; its
docstring says how text, special tokens and invalid UTF-8 are handled).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from longnet.hf.pretrained import resolve_or_materialize
from longnet.modeling import LongNetConfig
from longnet.modeling.tokenizer_files import (
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    tokenizer_config,
    tokenizer_json,
)


def byte_tokenizer(config: LongNetConfig) -> PreTrainedTokenizerFast:
    """The byte tokenizer of a byte-level ``config`` (its special tokens), built in memory:
    for models that come without a folder (Lightning checkpoints).

    Raises:
        ValueError: ``config`` is not byte-level (``vocab_size != 256``).
    """
    options = tokenizer_config(config)
    options.pop("tokenizer_class")
    backend = Tokenizer.from_str(json.dumps(tokenizer_json()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **options)


def load_tokenizer(name_or_dir: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained`` of a model folder or zoo name, checking first that
    the tokenizer files are there.

    Raises:
        FileNotFoundError: no such model, or its folder lacks ``tokenizer.json`` /
            ``tokenizer_config.json`` (the message says how to write them).
    """
    folder = resolve_or_materialize(name_or_dir)
    check_tokenizer_files(folder)
    return AutoTokenizer.from_pretrained(folder)


def check_tokenizer_files(folder: Path) -> None:
    """Raise ``FileNotFoundError`` saying how to write them if the model folder ``folder``
    lacks ``tokenizer.json`` or ``tokenizer_config.json``."""
    missing = [name for name in (TOKENIZER_NAME, TOKENIZER_CONFIG_NAME)
               if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} has no {' or '.join(missing)}. Folders written by an older longnet "
            "lack them: for a byte-level model write them with "
            "longnet.modeling.write_tokenizer_files(folder, LongNetConfig.from_pretrained("
            "folder)), or build the tokenizer in memory with longnet.hf.byte_tokenizer(config)."
        )


class LongNetTokenizer(PreTrainedTokenizerFast):
    """What ``AutoTokenizer`` loads for a LongNet model whose folder names no tokenizer class
    (registered by ``import longnet.hf``). The folders LongNet writes name
    ``PreTrainedTokenizerFast`` in their ``tokenizer_config.json``, so only a folder without
    that file comes here: :meth:`from_pretrained` says how to write the tokenizer files
    (:func:`check_tokenizer_files`) where ``transformers`` would say that it cannot convert a
    slow tokenizer without sentencepiece."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *inputs: Any, **kwargs: Any
    ) -> PreTrainedTokenizerFast:
        """``PreTrainedTokenizerFast.from_pretrained``, after :func:`check_tokenizer_files` of
        a local folder."""
        folder = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        if folder.is_dir():
            check_tokenizer_files(folder)
        return PreTrainedTokenizerFast.from_pretrained(
            pretrained_model_name_or_path, *inputs, **kwargs)
