"""The data's tokenizer meets the model: its vocabulary and special ids given to a fresh model
(refused for pretrained weights of another vocabulary), recorded in every checkpoint (a
resume with another tokenizer is refused) and counted in bytes for bits per byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longnet.constants import IGNORE_INDEX
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import ByteTokenizer
from longnet.data.tokenizer_choice import BYTES
from longnet.modeling import LongNetConfig
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
    """The :class:`TokenIds` of a datamodule that chooses a subword tokenizer (one whose
    ``tokenizer_choice`` is not bytes: ``LongDocumentDataModule``), else None: byte data
    leaves the model as configured."""
    choice = getattr(datamodule, "tokenizer_choice", None)
    if choice is None or choice.kind == BYTES:
        return None
    return TokenIds(datamodule.vocab_size, datamodule.eos_id, datamodule.pad_id)


def fitted_overrides(ids: TokenIds, config: LongNetConfig, hparams: Any) -> dict | None:
    """The config overrides that give a fresh model the data's vocabulary and special ids
    (None: the model already has them).

    Pretrained weights keep their config (their EOS id included) when their ``vocab_size`` is
    the tokenizer's.

    Raises:
        UsageError: ``pretrained`` weights of another vocabulary size, or a ``vocab_size`` set
            in the config or overrides that is smaller than the tokenizer's (each names both
            values and the fix).
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


def tokenizer_record(tokenizer: ByteTokenizer | SubwordTokenizer) -> dict[str, Any]:
    """What a checkpoint keeps of the data's tokenizer: ``name``, ``fingerprint`` and the
    ``files`` of a subword tokenizer (``save_pretrained`` layout); ``{"name": "bytes"}``."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"name": "bytes"}
    return {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
            "files": dict(tokenizer.files)}


def check_tokenizer_record(record: dict[str, Any] | None,
                           tokenizer: ByteTokenizer | SubwordTokenizer) -> None:
    """Refuse to resume a checkpoint trained with another tokenizer than the data's.

    Raises:
        UsageError: the fingerprints differ (the message names both tokenizers and the fix).
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
    """``(batch,)`` UTF-8 bytes covered by the scored labels (``labels`` ``(batch, seq)``,
    -100 not scored) of each sample: the data's ``label_bytes`` where it has them, else
    ``bytes_per_token`` per scored label other than ``eos_id`` (byte text: one per byte)."""
    scored = labels != IGNORE_INDEX
    if LABEL_BYTES in batch:
        return (batch[LABEL_BYTES] * scored).sum(-1)
    if eos_id is not None:
        scored = scored & (labels != eos_id)
    return scored.sum(-1).to(torch.float64) * bytes_per_token
