"""The data's tokenizers: UTF-8 bytes (:class:`ByteTokenizer`) and the ``tokenizer`` option.

The byte vocabulary is the 256 byte values; two that valid UTF-8 never contains are special:
``EOS_ID = 255`` frames documents, ``PAD_ID = 254`` fills inputs past a document's end.

The ``tokenizer`` option (:func:`parse_tokenizer`): ``"bytes"``, ``"bpe:<n>"`` (trained on the
training split, :func:`cached_bpe`), a ``tokenizer.json``, a tokenizer or model folder, a zoo name.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longnet.data.cache import build_once, fingerprint
from longnet.data.subword import (
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    SubwordTokenizer,
    from_backend,
    load_tokenizer_folder,
    load_tokenizer_json,
)
from longnet.modeling.hub import resolve_model_dir, unmaterialized_hint
from longnet.validation import UsageError, is_int

VOCAB_SIZE = 256
EOS_ID = 0xFF
PAD_ID = 0xFE


class ByteTokenizer:
    """UTF-8 bytes as tokens (module docstring)."""

    vocab_size: int = VOCAB_SIZE
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    def encode_array(self, text: str) -> np.ndarray:
        """``text``'s UTF-8 bytes, ``(n_bytes,)`` uint8; lone surrogates become ``?``."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        """``text`` as a list of byte ids in ``[0, 256)``."""
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        """Byte ids back to text (invalid UTF-8: U+FFFD); ``ValueError`` outside ``[0, 256)``."""
        values = np.fromiter((int(i) for i in ids), dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= VOCAB_SIZE):
            bad = values[(values < 0) | (values >= VOCAB_SIZE)][0]
            raise ValueError(
                f"ByteTokenizer.decode: id {int(bad)} is outside [0, {VOCAB_SIZE}); drop "
                "ignored label positions (-100) before decoding."
            )
        return values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


BYTES = "bytes"
BPE_PREFIX = "bpe:"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BPE_SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
MIN_BPE_VOCAB = VOCAB_SIZE + len(BPE_SPECIAL_TOKENS)
MAX_VOCAB = 2**20
"""The largest vocabulary the data stores (int32 ids; ``LongNetConfig`` sets no bound)."""
BPE_FORMAT_VERSION = 1
INFO_FILE = "info.json"

TOKENIZER_FORMS = (
    f"give a {TOKENIZER_FILE} file (Tokenizer.save(path)), a tokenizer folder holding "
    f"{TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE} (tokenizer.save_pretrained(folder), as a "
    "model folder holds them), 'bytes', 'bpe:<vocab size>' (e.g. 'bpe:8192') or a zoo name."
)

Tokenizers = ByteTokenizer | SubwordTokenizer


@dataclass(frozen=True)
class TokenizerChoice:
    """A parsed ``tokenizer`` option: ``kind`` (``"bytes"``, ``"bpe"``, ``"file"``, ``"folder"``),
    a BPE's ``bpe_vocab_size`` or the ``loaded`` tokenizer."""

    kind: str
    bpe_vocab_size: int | None = None
    loaded: Tokenizers | None = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary for this tokenizer (known before any BPE is trained)."""
        return self.bpe_vocab_size if self.loaded is None else self.loaded.vocab_size

    @property
    def eos_id(self) -> int:
        return 0 if self.loaded is None else self.loaded.eos_id

    @property
    def pad_id(self) -> int:
        return 1 if self.loaded is None else self.loaded.pad_id

    def resolve(self, texts: Callable[[], Iterable[str]], key: dict, cache_dir: Path) -> Tokenizers:
        """The tokenizer; a BPE is trained on ``texts()`` unless cached under ``key``."""
        if self.loaded is not None:
            return self.loaded
        return cached_bpe(texts, self.bpe_vocab_size, key, cache_dir)


def parse_tokenizer(value: str | None) -> TokenizerChoice:
    """The :class:`TokenizerChoice` of a ``tokenizer`` option (module docstring).

    Raises:
        UsageError: a bad BPE size, a path that is not a tokenizer, or a bad zoo name.
    """
    if value is None or value == BYTES:
        return TokenizerChoice(BYTES, loaded=ByteTokenizer())
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"tokenizer must be 'bytes', 'bpe:<vocab size>' or a path, got {value!r}.")
    if value.startswith(BPE_PREFIX):
        return TokenizerChoice("bpe", bpe_vocab_size=_bpe_size(value))
    path = Path(value).expanduser()
    if path.is_file():
        choice = TokenizerChoice("file", loaded=load_tokenizer_json(path))
    elif path.is_dir():
        choice = TokenizerChoice("folder", loaded=load_tokenizer_folder(path))
    elif "/" in value or value.endswith(".json"):
        raise UsageError(f"tokenizer {value!r}: no such file or folder; {TOKENIZER_FORMS}")
    else:
        choice = TokenizerChoice("folder", loaded=zoo_tokenizer(value))
    if choice.vocab_size > MAX_VOCAB:
        raise UsageError(f"tokenizer {value}: {choice.vocab_size} ids, above the {MAX_VOCAB} "
                         "the data stores; use a smaller vocabulary.")
    return choice


def zoo_tokenizer(name: str) -> SubwordTokenizer:
    """The tokenizer of the zoo model ``name``, named as asked (checkpoints record the name).

    Raises:
        UsageError: an unknown name, an entry not materialized here, or a folder without
            tokenizer files.
    """
    try:
        folder = resolve_model_dir(name)
    except FileNotFoundError as err:
        raise UsageError(f"tokenizer {name!r} is not 'bytes', 'bpe:<vocab size>', a "
                         f"tokenizer.json, a tokenizer folder or a model: {err}") from None
    hint = unmaterialized_hint(folder)
    if hint is not None:
        raise UsageError(f"tokenizer {name!r}: {hint}")
    return replace(load_tokenizer_folder(folder), name=name)


def _bpe_size(value: str) -> int:
    text = value[len(BPE_PREFIX):]
    size = int(text) if text.isdigit() else None
    if size is None or not MIN_BPE_VOCAB <= size <= MAX_VOCAB:
        raise UsageError(
            f"tokenizer {value!r}: the BPE vocabulary size must be an integer in "
            f"[{MIN_BPE_VOCAB}, {MAX_VOCAB}] (the 256 byte tokens and the special tokens "
            f"{', '.join(BPE_SPECIAL_TOKENS)} come first), e.g. 'bpe:8192'."
        )
    return size


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts`` (GPT-2's
    pre-tokenization, the 256 byte tokens, :data:`BPE_SPECIAL_TOKENS` as ids 0, 1)."""
    if not is_int(vocab_size) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size must be an integer >= {MIN_BPE_VOCAB}, got {vocab_size!r}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def bpe_cache_key(vocab_size: int, key: dict) -> str:
    """The cache key of a BPE of ``vocab_size`` on the documents ``key`` describes."""
    return fingerprint({"version": BPE_FORMAT_VERSION, "vocab_size": vocab_size, **key})


def cached_bpe(texts: Callable[[], Iterable[str]], vocab_size: int, key: dict,
               cache_dir: Path) -> SubwordTokenizer:
    """The BPE of ``vocab_size`` for ``key``: from ``cache_dir``, else trained and stored."""
    entry = Path(cache_dir) / f"bpe{vocab_size}-{bpe_cache_key(vocab_size, key)}"

    def build(staging: Path) -> None:
        started = time.perf_counter()
        tokenizer = train_bpe(texts(), vocab_size)
        seconds = time.perf_counter() - started
        tokenizer.save(str(staging / TOKENIZER_FILE))
        trained = from_backend(tokenizer, name, EOS_TOKEN, PAD_TOKEN)
        (staging / INFO_FILE).write_text(json.dumps(
            {"vocab_size": tokenizer.get_vocab_size(), "asked": vocab_size,
             "seconds": round(seconds, 2), "fingerprint": trained.fingerprint, **key},
            indent=2) + "\n")
        print(f"Trained a byte-level BPE of {tokenizer.get_vocab_size()} ids on the training "
              f"split in {seconds:.1f} s ({entry}).", file=sys.stderr, flush=True)

    name = f"{BPE_PREFIX}{vocab_size}"
    build_once(entry, build)
    try:
        backend = Tokenizer.from_file(str(entry / TOKENIZER_FILE))
        recorded = json.loads((entry / INFO_FILE).read_text())["fingerprint"]
    except Exception as err:  # the library raises a plain Exception for a bad file
        raise UsageError(
            f"the BPE cache entry {entry} is damaged ({err}); delete it (rm -r {entry}) and run "
            "again to train it anew."
        ) from None
    loaded = from_backend(backend, name, EOS_TOKEN, PAD_TOKEN)
    if loaded.fingerprint != recorded:
        raise UsageError(
            f"the BPE cache entry {entry} holds a tokenizer changed since it was trained "
            f"(fingerprint {loaded.fingerprint}, trained {recorded}); delete it (rm -r {entry}) "
            "and run again to train it anew, or pass your own tokenizer as a tokenizer.json path."
        )
    return loaded
