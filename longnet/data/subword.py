"""Subword tokenizers (BPE and any ``tokenizers``-library tokenizer) as the data reads them.

A :class:`SubwordTokenizer` carries its end-of-document and padding ids and its Hugging Face
files, so run folders, checkpoints and exports hold the tokenizer the data was built with.
Encoding also returns the UTF-8 bytes each token covers (from the offsets), what bits per byte
divide by, so byte and subword models are compared on the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from longnet.files import write_atomic
from longnet.modeling.config import MODEL_TYPE
from longnet.modeling.hub import folder_config
from longnet.validation import UsageError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
"""End-of-document tokens looked for, in order, in a ``tokenizer.json`` given alone."""
RUN_TOKENIZER_FOLDER = "tokenizer"
"""The run folder's copy of the data's subword tokenizer (``save_pretrained`` layout)."""
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


@dataclass(frozen=True)
class SubwordTokenizer:
    """A tokenizer of the ``tokenizers`` library with its special ids and files.

    Attributes:
        backend: the tokenizer.
        eos_id: the id framing documents.
        pad_id: the id filling inputs past a document's end (the EOS id when there is none).
        files: file name -> text of the ``save_pretrained`` layout.
        name: what was asked for, for messages (``"bpe:8192"``, a path).
    """

    backend: Tokenizer = field(repr=False)
    eos_id: int
    pad_id: int
    files: Mapping[str, str] = field(repr=False)
    name: str

    @property
    def vocab_size(self) -> int:
        """Ids are ``0 .. vocab_size - 1`` (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 (16 hex digits) of ``tokenizer.json`` and the special ids."""
        payload = json.dumps({"tokenizer": json.loads(self.backend.to_str()),
                              "eos_id": self.eos_id, "pad_id": self.pad_id}, sort_keys=True)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]

    def encode_documents(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text ``(ids, token_bytes)``, both ``(n,)`` int64 (lone surrogates read as ``?``)."""
        texts = [_encodable(text or "") for text in texts]
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(encoding.ids, dtype=np.int64), _token_bytes(text, encoding.offsets))
                for text, encoding in zip(texts, encodings)]

    def encode(self, text: str) -> list[int]:
        """``text``'s ids (no special tokens added)."""
        return self.backend.encode(_encodable(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text, special tokens left out."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, folder: str | Path) -> list[Path]:
        """Write :attr:`files` into ``folder`` atomically; returns the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return [write_atomic(folder / name, text) for name, text in sorted(self.files.items())]


def _encodable(text: str) -> str:
    """``text`` with lone surrogates replaced by ``?`` (the tokenizer refuses them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def _token_bytes(text: str, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """UTF-8 bytes covered by each token of ``text`` from its character ``offsets``: a split
    character counts for its first token, trimmed bytes (spaces) for the next one."""
    if not offsets:
        return np.zeros(0, dtype=np.int64)
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    byte_at = np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])  # char -> byte offset
    ends = byte_at[np.asarray([end for _, end in offsets], dtype=np.int64)]
    ends = np.maximum.accumulate(ends)
    ends[-1] = byte_at[-1]
    return np.diff(ends, prepend=0)


ROUND_TRIP_CONTEXT = 20
"""Characters of the text and of its decoding shown from their first difference."""
ROUND_TRIP_FIX = (
    "use a tokenizer that keeps every byte: a byte-level BPE trained on the data "
    "(--data.init_args.tokenizer bpe:8192), or give yours byte fallback (the tokenizers "
    "library: models.BPE(byte_fallback=True) or models.Unigram(vocab, byte_fallback=True) with "
    "<0x00>..<0xFF> byte tokens and decoders.ByteFallback, and no normalizer that changes text)."
)


def check_round_trip(tokenizer: SubwordTokenizer, texts: Sequence[tuple[str, str]]) -> None:
    """``UsageError`` unless ``tokenizer`` decodes each of ``texts`` (``(what, text)``) back."""
    for what, text in texts:
        text = _encodable(text)
        ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
        decoded = tokenizer.backend.decode(ids, skip_special_tokens=False)
        if decoded != text:
            raise UsageError(_round_trip_message(tokenizer, what, text, decoded, ids))


def _round_trip_message(tokenizer: SubwordTokenizer, what: str, text: str, decoded: str,
                        ids: Sequence[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(text, decoded)) if a != b),
              min(len(text), len(decoded)))
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    end = at + ROUND_TRIP_CONTEXT
    unknown = _unknown_token(tokenizer.backend)
    unknown_id = None if unknown is None else tokenizer.backend.token_to_id(unknown)
    count = sum(1 for i in ids if i == unknown_id)
    unknowns = (f"; {count} of its {len(ids)} tokens are the unknown token {unknown}"
                if count else "")
    return (
        f"tokenizer {tokenizer.name} does not give back the training text, so its bits per "
        f"byte would not measure that text: decoding {what} differs from it at character "
        f"{at} (line {line}, column {column}): the text has {text[at:end]!r}, the decoding "
        f"{decoded[at:end]!r}{unknowns}. Refused: {ROUND_TRIP_FIX}"
    )


def _unknown_token(backend: Tokenizer) -> str | None:
    """The unknown token of ``backend``'s model (``unk_token`` or Unigram's ``unk_id``), or None."""
    model = json.loads(backend.to_str()).get("model", {})
    if model.get("unk_token"):
        return model["unk_token"]
    index, vocab = model.get("unk_id"), model.get("vocab")
    return vocab[index][0] if isinstance(index, int) and isinstance(vocab, list) else None


def tokenizer_config(eos_token: str, pad_token: str) -> dict[str, object]:
    """The ``tokenizer_config.json`` of a tokenizer written here (``PreTrainedTokenizerFast``)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
            "pad_token": pad_token, "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"]}


def from_backend(backend: Tokenizer, name: str, eos_token: str | None = None,
                 pad_token: str | None = None) -> SubwordTokenizer:
    """A :class:`SubwordTokenizer` of ``backend``: the special tokens given, else the first of
    :data:`EOS_NAMES` / :data:`PAD_NAMES` it has (no padding token: the EOS pads).

    Raises:
        UsageError: the tokenizer has no end-of-document token.
    """
    vocab = backend.get_vocab(with_added_tokens=True)
    eos_token = eos_token or next((token for token in EOS_NAMES if token in vocab), None)
    if eos_token is None or eos_token not in vocab:
        raise UsageError(
            f"tokenizer {name}: no end-of-document token (looked for {eos_token or EOS_NAMES}); "
            "add one as a special token (tokenizers: tokenizer.add_special_tokens(['<|endoftext|>'"
            "]), then save it) or give a Hugging Face tokenizer folder whose "
            f"{TOKENIZER_CONFIG_FILE} names its eos_token."
        )
    pad_token = pad_token or next((token for token in PAD_NAMES if token in vocab), eos_token)
    files = {TOKENIZER_FILE: backend.to_str(pretty=True) + "\n",
             TOKENIZER_CONFIG_FILE: json.dumps(tokenizer_config(eos_token, pad_token),
                                               indent=2) + "\n"}
    return SubwordTokenizer(backend, vocab[eos_token], vocab[pad_token], files, name)


def load_tokenizer_json(path: str | Path) -> SubwordTokenizer:
    """A ``tokenizer.json`` file of the ``tokenizers`` library.

    Raises:
        UsageError: the file is not a tokenizer, or has no end-of-document token.
    """
    path = Path(path)
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises a plain Exception for any bad file
        raise UsageError(
            f"tokenizer {path} is not a tokenizer.json of the tokenizers library ({err}); give "
            "a file written by Tokenizer.save(path), a Hugging Face tokenizer folder, 'bytes' "
            "or 'bpe:<vocabulary size>'."
        ) from None
    return from_backend(backend, str(path))


def load_tokenizer_folder(folder: str | Path) -> SubwordTokenizer:
    """A Hugging Face tokenizer folder (``save_pretrained`` layout), read offline.

    Raises:
        UsageError: a missing file or ``transformers``, no fast tokenizer or no eos_token.
    """
    folder = Path(folder)
    missing = [name for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
               if not (folder / name).is_file()]
    if missing:
        run = folder / RUN_TOKENIZER_FOLDER
        inside = (f"it is a training run's folder: its tokenizer is {run}. "
                  if (run / TOKENIZER_FILE).is_file() else "")
        raise UsageError(
            f"tokenizer folder {folder} lacks {' and '.join(missing)}; {inside}give a folder "
            "written by tokenizer.save_pretrained(folder) (a model folder of longnet or "
            "transformers with its tokenizer), or the tokenizer.json file itself."
        )
    try:
        from transformers import AutoTokenizer, PreTrainedConfig
    except ImportError:
        raise UsageError(
            f"reading the tokenizer folder {folder} needs transformers: pip install "
            "'longnet[hf]', or give its tokenizer.json file instead."
        ) from None
    # a longnet model folder: spare transformers reading (and warning about) its config.json
    ours = folder_config(folder).get("model_type") == MODEL_TYPE
    blank = {"config": PreTrainedConfig()} if ours else {}
    try:
        loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **blank)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"tokenizer folder {folder} cannot be read by AutoTokenizer: {err}") \
            from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None or loaded.eos_token_id is None:
        what = "no fast tokenizer" if backend is None else "no eos_token"
        raise UsageError(
            f"tokenizer folder {folder} has {what}; longnet needs a fast (tokenizers) tokenizer "
            f"with an eos_token in {TOKENIZER_CONFIG_FILE}."
        )
    files = folder_tokenizer_files(folder)
    pad = loaded.pad_token_id if loaded.pad_token_id is not None else loaded.eos_token_id
    return SubwordTokenizer(backend, loaded.eos_token_id, pad, files, str(folder))


_SAVED_FILES = frozenset({TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                          "added_tokens.json", "chat_template.jinja", "vocab.json",
                          "merges.txt"})
"""The tokenizer files of a folder that travel with the data."""


def folder_tokenizer_files(folder: str | Path) -> dict[str, str]:
    """File name -> text of the tokenizer files ``folder`` holds."""
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(Path(folder).iterdir())
            if path.is_file() and path.name in _SAVED_FILES}


def tokenizer_from_files(files: Mapping[str, str], name: str) -> SubwordTokenizer:
    """The :class:`SubwordTokenizer` of ``files`` (a checkpoint's record).

    Raises:
        UsageError: ``tokenizer.json`` is missing or not a tokenizer.
    """
    try:
        backend = Tokenizer.from_str(files[TOKENIZER_FILE])
    except Exception as err:  # KeyError, or the library's plain Exception for a bad file
        raise UsageError(f"tokenizer {name}: no readable {TOKENIZER_FILE} ({err}).") from None
    options = json.loads(files.get(TOKENIZER_CONFIG_FILE, "{}"))
    tokens = {key: _token_text(options.get(key)) for key in ("eos_token", "pad_token")}
    return replace(from_backend(backend, name, tokens["eos_token"], tokens["pad_token"]),
                   files=dict(files))


def _token_text(value: object) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value
