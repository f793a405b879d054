"""Byte-level tokenization: a token is one byte of the UTF-8 encoding, nothing to download.

The vocabulary is exactly the 256 byte values, so every model with ``vocab_size=256`` can read
every sample. Two ids double as special tokens because valid UTF-8 never contains them (bytes
0xF5-0xFF never occur in UTF-8), so they can never collide with text:

- ``EOS_ID = 255`` (0xFF) separates documents: every document starts after one, and one ends it.
- ``PAD_ID = 254`` (0xFE) fills input positions past the end of a document; their labels are
  always ``IGNORE_INDEX`` so no loss is ever taken on them.

``decode`` renders these two ids (like any invalid byte) as U+FFFD.

The same vocabulary ships as Hugging Face tokenizer files next to every byte-level model
(``longnet.modeling.tokenizer_files``), so ``transformers.AutoTokenizer`` encodes as this class.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

VOCAB_SIZE = 256
EOS_ID = 0xFF
PAD_ID = 0xFE


class ByteTokenizer:
    """UTF-8 bytes as tokens. ``vocab_size`` is 256; ``eos_id`` and ``pad_id`` are bytes UTF-8
    never produces (see the module docstring)."""

    vocab_size: int = VOCAB_SIZE
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    def encode_array(self, text: str) -> np.ndarray:
        """``text`` as a ``(len(text.encode()),)`` uint8 array of its UTF-8 bytes.

        Lone surrogates (which UTF-8 cannot encode) become ``?``.
        """
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        """``text`` as a list of byte ids in ``[0, 256)``."""
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        """Byte ids back to text; invalid UTF-8 (including EOS/PAD) decodes to U+FFFD.

        ``ids`` may be a list, a numpy array or a 1-d tensor. Ids outside ``[0, 256)`` (for
        example the label value -100) raise ``ValueError``; drop them first.
        """
        values = np.fromiter((int(i) for i in ids), dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= VOCAB_SIZE):
            bad = values[(values < 0) | (values >= VOCAB_SIZE)][0]
            raise ValueError(
                f"ByteTokenizer.decode: id {int(bad)} is outside [0, {VOCAB_SIZE}); drop "
                "ignored label positions (-100) before decoding."
            )
        return values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
