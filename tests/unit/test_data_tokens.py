"""Byte tokenizer and window cutting (pure numpy, no datasets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longnet.data.encoding import IGNORE_INDEX, document_windows, packed_windows, shifted_sample
from longnet.data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer

TEXTS = ["", "hello", "naïve café — 東京 🚀\n\tend", "a" * 1000]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tokenizer.decode(np.array(ids)) == text


def test_special_ids_never_occur_in_text() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == VOCAB_SIZE == 256
    every_char = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    ids = set(tokenizer.encode(every_char))
    assert EOS_ID not in ids and PAD_ID not in ids
    assert tokenizer.decode([104, 105, EOS_ID]) == "hi\ufffd"


def test_decode_rejects_ids_outside_vocab() -> None:
    with pytest.raises(ValueError, match="-100"):
        ByteTokenizer().decode([104, IGNORE_INDEX])
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer().decode([256])


def test_shifted_sample() -> None:
    tokens = np.arange(10, 17)
    sample = shifted_sample(tokens)
    assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
    assert sample["input_ids"].tolist() == list(range(10, 16))
    assert sample["labels"].tolist() == list(range(11, 17))
    masked = shifted_sample(tokens, np.array([0, 0, 1, 0, 0, 1], dtype=bool))
    assert masked["labels"].tolist() == [IGNORE_INDEX] * 2 + [13] + [IGNORE_INDEX] * 2 + [16]


def _docs(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=n).astype(np.uint8) for n in lengths]


@pytest.mark.parametrize("seq_len", [1, 4, 7, 64])
def test_packed_windows_cover_the_stream_once(seq_len: int) -> None:
    docs = _docs([5, 0, 17, 3, 40])
    inputs, labels = packed_windows(docs, seq_len)
    stream = np.concatenate([np.r_[EOS_ID, doc] for doc in docs] + [[EOS_ID]])
    count = (len(stream) - 1) // seq_len
    assert inputs.shape == labels.shape == (count, seq_len)
    assert inputs.dtype == np.uint8 and labels.dtype == np.int16
    np.testing.assert_array_equal(inputs.reshape(-1), stream[: count * seq_len])
    np.testing.assert_array_equal(labels.reshape(-1), stream[1 : count * seq_len + 1])


def test_packed_windows_of_too_little_text_is_empty() -> None:
    inputs, labels = packed_windows(_docs([3]), 16)
    assert inputs.shape == labels.shape == (0, 16)


@pytest.mark.parametrize(("length", "seq_len"), [(0, 4), (1, 4), (2, 4), (3, 4), (10, 4), (5, 64)])
def test_document_windows_stay_inside_the_document(length: int, seq_len: int) -> None:
    (doc,) = _docs([length])
    inputs, labels, offsets = document_windows(doc, seq_len)
    framed = np.r_[EOS_ID, doc, EOS_ID]
    assert len(offsets) == -(-(len(framed) - 1) // seq_len)
    np.testing.assert_array_equal(offsets, np.arange(len(offsets)) * seq_len)
    padded = np.r_[framed, np.full(len(offsets) * seq_len + 1 - len(framed), -1)]
    for window, offset in enumerate(offsets):
        expected_inputs = padded[offset : offset + seq_len]
        expected_labels = padded[offset + 1 : offset + seq_len + 1]
        np.testing.assert_array_equal(
            inputs[window], np.where(expected_inputs < 0, PAD_ID, expected_inputs)
        )
        np.testing.assert_array_equal(
            labels[window], np.where(expected_labels < 0, IGNORE_INDEX, expected_labels)
        )
    # every byte of the document and the closing EOS is a label exactly once
    scored = labels[labels != IGNORE_INDEX]
    np.testing.assert_array_equal(scored, framed[1:])
