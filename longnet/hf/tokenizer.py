"""The byte tokenizer as a ``transformers`` tokenizer, from a model folder or in memory (the
JSON of :mod:`longnet.modeling.tokenizer_files`).
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
    """The byte tokenizer of a byte-level ``config``, in memory (for Lightning checkpoints).

    Raises:
        ValueError: ``config`` is not byte-level (``vocab_size != 256``).
    """
    options = tokenizer_config(config)
    options.pop("tokenizer_class")
    backend = Tokenizer.from_str(json.dumps(tokenizer_json()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **options)


def load_tokenizer(name_or_dir: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained`` of a model folder or zoo name, files checked first.

    Raises:
        FileNotFoundError: no such model, or its folder lacks ``tokenizer.json`` /
            ``tokenizer_config.json`` (the message says how to write them).
    """
    folder = resolve_or_materialize(name_or_dir)
    check_tokenizer_files(folder)
    return AutoTokenizer.from_pretrained(folder)


def check_tokenizer_files(folder: Path) -> None:
    """Raise ``FileNotFoundError`` saying how to write them if ``folder`` lacks
    ``tokenizer.json`` or ``tokenizer_config.json``."""
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
    """What ``AutoTokenizer`` loads for a LongNet folder that names no tokenizer class (one
    without ``tokenizer_config.json``): it says how to write the tokenizer files, where
    ``transformers`` would ask for sentencepiece."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *inputs: Any, **kwargs: Any
    ) -> PreTrainedTokenizerFast:
        """``PreTrainedTokenizerFast.from_pretrained``, a local folder checked first."""
        folder = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        if folder.is_dir():
            check_tokenizer_files(folder)
        return PreTrainedTokenizerFast.from_pretrained(
            pretrained_model_name_or_path, *inputs, **kwargs)
