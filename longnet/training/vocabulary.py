"""The data meets the model: the tokenizer's vocabulary given to a fresh model (pretrained
weights must match), recorded in checkpoints (checked on resume), counted in bytes for bits per
byte; the window length a datamodule serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longnet.constants import IGNORE_INDEX
from longnet.data.subword import (
    TOKENIZER_FILE,
    SubwordTokenizer,
    folder_tokenizer_files,
    tokenizer_from_files,
)
from longnet.data.tokenizer import BYTES, ByteTokenizer
from longnet.modeling import LongNetConfig
from longnet.modeling.hub import resolve_model_dir
from longnet.validation import UsageError

TOKENIZER_KEY = "longnet_tokenizer"
"""The checkpoint entry holding the tokenizer: its name, fingerprint and files."""
LABEL_BYTES = "label_bytes"


@dataclass(frozen=True)
class TokenIds:
    """A tokenizer's vocabulary size and end-of-document and padding ids."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def matches(self, config: LongNetConfig) -> bool:
        return (config.vocab_size, config.eos_token_id, config.pad_token_id) == \
            (self.vocab_size, self.eos_id, self.pad_id)


def data_token_ids(datamodule: Any) -> TokenIds | None:
    """The :class:`TokenIds` of a datamodule that chooses a subword tokenizer, else None."""
    choice = getattr(datamodule, "tokenizer_choice", None)
    if choice is None or choice.kind == BYTES:
        return None
    return TokenIds(datamodule.vocab_size, datamodule.eos_id, datamodule.pad_id)


def datamodule_seq_len(datamodule: Any) -> int | None:
    """The window length ``datamodule`` serves (``seq_len`` or ``settings.seq_len``), or None."""
    seq_len = getattr(datamodule, "seq_len", None)
    if seq_len is None:
        seq_len = getattr(getattr(datamodule, "settings", None), "seq_len", None)
    return seq_len if isinstance(seq_len, int) else None


def fitted_overrides(ids: TokenIds, config: LongNetConfig, hparams: Any) -> dict | None:
    """The config overrides giving a fresh model the data's vocabulary and special ids (None:
    it has them, or pretrained weights of the same ``vocab_size``).

    Raises:
        UsageError: pretrained weights of another ``vocab_size``, or a configured one below it.
    """
    if ids.matches(config):
        return None
    if hparams.get("pretrained") is not None:  # its weights fix the vocabulary
        if config.vocab_size == ids.vocab_size:
            return None
        raise UsageError(
            f"the pretrained model {hparams['pretrained']} has vocab_size {config.vocab_size} "
            f"but the data's tokenizer has {ids.vocab_size}; set --data.init_args.tokenizer "
            f"{hparams['pretrained']} (the model's own tokenizer), or train a fresh model "
            "(model: instead of pretrained:)."
        )
    overrides = dict(hparams.get("overrides") or {})
    fixed = overrides.get("vocab_size", (hparams.get("config") or {}).get("vocab_size"))
    if fixed is not None and fixed < ids.vocab_size:
        raise UsageError(
            f"the data's tokenizer has {ids.vocab_size} ids, above the vocab_size {fixed} the "
            "model config sets; remove vocab_size from the config (the tokenizer sets it) or "
            f"set it to at least {ids.vocab_size}."
        )
    return overrides | {"vocab_size": ids.vocab_size if fixed is None else fixed,
                        "eos_token_id": ids.eos_id, "pad_token_id": ids.pad_id}


def check_pretrained_tokenizer(pretrained: str | None, config: LongNetConfig,
                               tokenizer: ByteTokenizer | SubwordTokenizer | None) -> None:
    """Refuse ``pretrained`` weights whose own tokenizer (by file fingerprint, else
    ``config``'s sizes and ids) is not the data's; nothing when either is None.

    Raises:
        UsageError: naming both tokenizers, what differs and the fix.
    """
    if pretrained is None or tokenizer is None:
        return
    folder = resolve_model_dir(pretrained)
    own_files = None if isinstance(tokenizer, ByteTokenizer) or not (
        folder / TOKENIZER_FILE).is_file() else folder_tokenizer_files(folder)
    if own_files is not None and own_files == dict(tokenizer.files):
        return  # the model's own files (the data names its folder): nothing to read
    own = _config_facts(config) if own_files is None else \
        _tokenizer_facts(tokenizer_from_files(own_files, str(folder)))
    data = _tokenizer_facts(tokenizer)
    differ = [name for name, value in own.items() if value is not None and value != data[name]]
    if not differ:
        return
    where = "its config" if own_files is None else f"{folder / TOKENIZER_FILE}"
    raise UsageError(
        f"the pretrained model {pretrained} reads its own tokenizer ({_described(own)}; "
        f"{where}), but the data's tokenizer {getattr(tokenizer, 'name', BYTES)} has "
        f"{_described(data)}: they differ in {', '.join(differ)}, so the weights would read "
        f"other tokens than they learned. Set --data.init_args.tokenizer {pretrained} (the model's "
        "own tokenizer), or train a fresh model (model: instead of pretrained:)."
    )


def _tokenizer_facts(tokenizer: ByteTokenizer | SubwordTokenizer) -> dict[str, Any]:
    """Sizes, special ids and files' fingerprint (None for bytes) of ``tokenizer``."""
    fingerprint = None if isinstance(tokenizer, ByteTokenizer) else \
        tokenizer_from_files(tokenizer.files, tokenizer.name).fingerprint
    return {"vocabulary size": tokenizer.vocab_size, "end-of-document id": tokenizer.eos_id,
            "padding id": tokenizer.pad_id, "fingerprint": fingerprint}


def _config_facts(config: LongNetConfig) -> dict[str, Any]:
    """The facts of :func:`_tokenizer_facts` a model config sets (None: not set)."""
    return {"vocabulary size": config.vocab_size, "end-of-document id": config.eos_token_id,
            "padding id": config.pad_token_id, "fingerprint": None}


def _described(facts: dict[str, Any]) -> str:
    """``facts`` for a message: ``"270 ids, end-of-document id 0, ..."``."""
    return ", ".join(f"{value} ids" if name == "vocabulary size" else f"{name} {value}"
                     for name, value in facts.items() if value is not None)


def tokenizer_record(tokenizer: ByteTokenizer | SubwordTokenizer) -> dict[str, Any]:
    """What checkpoints keep of the tokenizer: ``name``, ``fingerprint`` and ``files``."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"name": "bytes"}
    return {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
            "files": dict(tokenizer.files)}


def check_tokenizer_record(record: dict[str, Any] | None,
                           tokenizer: ByteTokenizer | SubwordTokenizer) -> None:
    """Refuse to resume a checkpoint trained with another tokenizer than the data's.

    Raises:
        UsageError: the fingerprints differ.
    """
    if record is None:
        return
    current = tokenizer_record(tokenizer)
    if record.get("fingerprint") != current.get("fingerprint"):
        raise UsageError(
            f"the checkpoint was trained with tokenizer {record.get('name')} (fingerprint "
            f"{record.get('fingerprint')}) but the data now uses {current['name']} "
            f"(fingerprint {current.get('fingerprint')}); set --data.init_args.tokenizer to the "
            "checkpoint's tokenizer (its files are under the run folder's tokenizer/), or start "
            "a new run without --ckpt_path."
        )


def scored_bytes(batch: dict[str, Tensor], labels: Tensor, eos_id: int | None,
                 bytes_per_token: float = 1.0) -> Tensor:
    """``(batch,)`` UTF-8 bytes covered by each sample's scored ``labels`` ``(batch, seq)``: the
    data's ``label_bytes``, else ``bytes_per_token`` per scored non-``eos_id`` label."""
    scored = labels != IGNORE_INDEX
    if LABEL_BYTES in batch:
        return (batch[LABEL_BYTES] * scored).sum(-1)
    if eos_id is not None:
        scored = scored & (labels != eos_id)
    return scored.sum(-1).to(torch.float64) * bytes_per_token
