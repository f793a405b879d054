"""The generated long-range tasks: passkey retrieval and multi-query associative recall.

Sample ``i`` of a split is generated from ``(seed, split, i)`` (:func:`sample_rng`).

Passkey retrieval (Mohtashami & Jaggi 2023), a sample of ``length`` ASCII bytes::

    <TASK><filler...><NEEDLE with the key><...filler>\\nWhat is the pass key? The pass key is <key>

The needle's byte is drawn from a window around the depth (:func:`needle_window`), so a cell's
examples do not share one alignment to the dilation rates (docs/architecture.md).

Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): ``num_kv_pairs``
key-value pairs (keys distinct, from the lower half of the vocabulary), then two-token slots
where ``num_queries`` keys are asked again (``0`` is filler); only queried keys are labelled::

    k3 v3 k1 v1 k2 v2 | 0 0 k1 v1 0 0 0 0 k3 v3 0 0 ...
                           ^ label v1        ^ label v3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from longnet.constants import IGNORE_INDEX
from longnet.data.encoding import SPLITS, shifted_sample
from longnet.data.subword import SubwordTokenizer
from longnet.data.tokenizer import ByteTokenizer
from longnet.validation import check_non_negative_int, check_positive_int, is_int

TASK = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is "
ANSWER_END = "."
NEEDLE_PREFIX = NEEDLE[:NEEDLE.index("{")]  # "The pass key is ": what precedes the key
NEEDLE_JITTER = len(FILLER) // 2
PASSKEY_PROBE_KEYS = 32  # examples min_passkey_tokens measures
LabelMode = Literal["answer", "recall", "all"]
MQAR_FILLER_ID = 0
SPLIT_STREAMS = {split: stream for stream, split in enumerate(SPLITS)}


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of sample ``index`` of ``split``: any sample is regenerated alone."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {sorted(SPLIT_STREAMS)}, got {split!r}.")
    check_non_negative_int("seed", seed)
    return np.random.default_rng([seed, SPLIT_STREAMS[split], index])


@dataclass(frozen=True)
class PasskeyExample:
    """One passkey prompt (the text before the key), answer (its digits) and needle depth."""

    prompt: str
    answer: str
    depth: float

    @property
    def needle_distance(self) -> int:
        """Bytes from the needle's first byte to the end of the prompt."""
        return len(self.prompt) - self.prompt.index(NEEDLE_PREFIX)

    @property
    def key_start(self) -> int:
        """The byte of the prompt where the needle's key begins."""
        return self.prompt.index(NEEDLE_PREFIX) + len(NEEDLE_PREFIX)


def min_passkey_length(num_digits: int = 5) -> int:
    """The shortest sample in bytes (answer included, no filler)."""
    return len(TASK) + len(NEEDLE.format(key="0" * num_digits)) + len(QUESTION) + num_digits


def min_passkey_tokens(tokenizer: SubwordTokenizer, num_digits: int = 5) -> int:
    """The shortest ``seq_len`` of a ``PasskeyDataset`` in ``tokenizer``'s tokens, the most over
    ``PASSKEY_PROBE_KEYS`` keys (a rarer key that takes more raises when drawn)."""
    check_passkey_options(num_digits=num_digits)
    shortest = min_passkey_length(num_digits)
    examples = [make_passkey_example(shortest, np.random.default_rng([num_digits, probe]), 0.0,
                                     num_digits) for probe in range(PASSKEY_PROBE_KEYS)]
    texts = [e.prompt + e.answer + ANSWER_END for e in examples]
    return max(len(ids) for ids, _ in tokenizer.encode_documents(texts)) - 1


def make_passkey_example(
    length: int, rng: np.random.Generator, depth: float | None = None, num_digits: int = 5
) -> PasskeyExample:
    """A passkey example of exactly ``length`` bytes, prompt plus answer."""
    _check_passkey_args(length, depth, num_digits)
    key = str(int(rng.integers(10 ** (num_digits - 1), 10**num_digits)))
    depth = float(rng.random()) if depth is None else depth
    budget = length - min_passkey_length(num_digits)
    filler = (FILLER * (budget // len(FILLER) + 1))[:budget]
    low, high = needle_window(budget, depth)
    cut = int(rng.integers(low, high + 1))
    prompt = TASK + filler[:cut] + NEEDLE.format(key=key) + filler[cut:] + QUESTION
    return PasskeyExample(prompt=prompt, answer=key, depth=cut / budget if budget else 0.0)


def needle_window(budget: int, depth: float) -> tuple[int, int]:
    """``(low, high)``: the filler bytes the needle may start at, one filler period around
    ``depth * budget`` (in a short filler a third of it, so that depths stay apart)."""
    jitter = min(NEEDLE_JITTER, budget // 6)
    low = min(max(0, round(depth * budget) - jitter), budget - 2 * jitter)
    return low, low + 2 * jitter


def _check_passkey_args(length: int, depth: float | None, num_digits: int) -> None:
    check_passkey_options(depth=depth, num_digits=num_digits)
    if length < min_passkey_length(num_digits):
        raise ValueError(
            f"passkey length {length} is too short: the task, needle and question need "
            f"{min_passkey_length(num_digits)} bytes with num_digits={num_digits}; raise seq_len."
        )


def check_passkey_options(
    label_mode: LabelMode = "answer", depth: float | None = None, num_digits: int = 5,
    seed: int = 0, split: str = "train",
) -> None:
    """``ValueError`` for a bad passkey setting (all ``PasskeyDataset`` checks but ``seq_len``)."""
    if label_mode not in ("answer", "recall", "all"):
        raise ValueError(
            f"label_mode must be 'answer', 'recall' or 'all', got {label_mode!r}."
        )
    if not is_int(num_digits) or not 1 <= num_digits <= 18:
        raise ValueError(f"num_digits must be an integer in [1, 18], got {num_digits!r}.")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] or None (random), got {depth!r}.")
    sample_rng(seed, split, 0)  # validates seed and split


def passkey_examples(
    count: int, length: int, depth: float | None = None, seed: int = 0, num_digits: int = 5
) -> list[PasskeyExample]:
    """``count`` examples of ``length`` bytes: those of ``PasskeyDataset(split="test")``."""
    return [
        make_passkey_example(length, sample_rng(seed, "test", index), depth, num_digits)
        for index in range(count)
    ]


def passkey_match(generated: str, answer: str) -> bool:
    """Exact match: ``generated`` starts with ``answer`` and no further digit follows it."""
    return generated.startswith(answer) and not generated[len(answer):len(answer) + 1].isdigit()


class PasskeyDataset(Dataset):
    """Map-style dataset of passkey samples, each generated from ``(seed, split, index)``.

    A sample is ``prompt + key + ANSWER_END``, ``seq_len + 1`` bytes (with a subword
    ``tokenizer``, tokens: the longest example that fits, right-padded, with ``"label_bytes"``).
    ``label_mode``: ``"answer"`` labels the key and the end mark; ``"recall"`` also the
    needle's second copy of the key; ``"all"`` every position.

    Raises:
        ValueError: a bad label mode, depth, number of digits, seed, split or size, or a
            ``seq_len`` too short (naming the minimum, in bytes or tokens).
    """

    def __init__(
        self,
        seq_len: int,
        size: int,
        seed: int = 0,
        split: str = "train",
        depth: float | None = None,
        num_digits: int = 5,
        label_mode: LabelMode = "answer",
        tokenizer: SubwordTokenizer | None = None,
    ) -> None:
        check_passkey_options(label_mode, depth, num_digits, seed, split)
        check_non_negative_int("size", size)
        if isinstance(tokenizer, SubwordTokenizer):
            shortest = min_passkey_tokens(tokenizer, num_digits)
            if not is_int(seq_len) or seq_len < shortest:
                raise ValueError(
                    f"passkey seq_len {seq_len!r} is too short for the tokens of "
                    f"{tokenizer.name}: the task, needle, question and answer take at least "
                    f"{shortest} tokens with num_digits={num_digits}; raise seq_len."
                )
        else:
            _check_passkey_args(seq_len, depth, num_digits)
        self.seq_len, self.size, self.seed, self.split = seq_len, size, seed, split
        self.depth, self.num_digits, self.label_mode = depth, num_digits, label_mode
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer

    def __len__(self) -> int:
        return self.size

    def example(self, index: int, length: int | None = None) -> PasskeyExample:
        """The text of sample ``index``, ``length`` bytes (default: the sample's)."""
        if length is None and isinstance(self.tokenizer, SubwordTokenizer):
            return self._fitting_example(index)[0]
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a dataset of {self.size}.")
        rng = sample_rng(self.seed, self.split, index)
        return make_passkey_example(length or self.seq_len, rng, self.depth, self.num_digits)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if isinstance(self.tokenizer, SubwordTokenizer):
            return self._subword_sample(index)
        example = self.example(index)
        tokens = self.tokenizer.encode_array(example.prompt + example.answer + ANSWER_END)
        if self.label_mode == "all":
            return shifted_sample(tokens)
        labelled = np.zeros(self.seq_len, dtype=bool)
        labelled[len(example.prompt) - 1:] = True
        if self.label_mode == "recall":  # the filler has no digits: the second find is the copy
            copy = example.prompt.find(example.answer, example.prompt.find(example.answer) + 1)
            labelled[copy - 1:copy - 1 + len(example.answer)] = True
        return shifted_sample(tokens, labelled)

    def _subword_sample(self, index: int) -> dict[str, torch.Tensor]:
        example, ids, counts = self._fitting_example(index)
        ends = np.cumsum(counts)  # byte offset where each token ends
        starts = ends - counts
        # the answer as the evaluation reads it: the prompt's final space, the key, its end mark
        spans = [(len(example.prompt.rstrip(" ").encode()), int(ends[-1]))]
        if self.label_mode == "recall":
            copy = example.prompt.find(example.answer, example.prompt.find(example.answer) + 1)
            spans.append((copy, copy + len(example.answer)))  # ASCII: bytes are characters
        covers = np.zeros(len(ids), dtype=bool)
        for low, high in spans:
            covers |= (ends > low) & (starts < high)
        if self.label_mode == "all":
            covers[:] = True
        tokens = np.full(self.seq_len + 1, self.tokenizer.pad_id, dtype=np.int64)
        tokens[:len(ids)] = ids
        labelled = np.zeros(self.seq_len, dtype=bool)
        labelled[:len(ids) - 1] = covers[1:]
        sample = shifted_sample(tokens, labelled)
        label_bytes = np.zeros(self.seq_len, dtype=np.int64)
        label_bytes[:len(ids) - 1] = counts[1:]
        sample["label_bytes"] = torch.from_numpy(label_bytes)
        sample["label_bytes"][sample["labels"] == IGNORE_INDEX] = 0
        return sample

    def _fitting_example(self, index: int) -> tuple[PasskeyExample, np.ndarray, np.ndarray]:
        """The longest example of ``index`` that fits, its ids and each token's bytes."""
        shortest = min_passkey_length(self.num_digits)
        filler = FILLER * 16  # what a long example is made of: 10 % more bytes than it takes
        bytes_per_token = len(filler) / len(self.tokenizer.encode(filler))
        length = max(shortest, int(1.1 * bytes_per_token * (self.seq_len + 1)))
        while True:
            example = self.example(index, length)
            text = example.prompt + example.answer + ANSWER_END
            ((ids, counts),) = self.tokenizer.encode_documents([text])
            excess = len(ids) - (self.seq_len + 1)
            if excess <= 0:
                return example, ids, counts
            if length == shortest:
                raise ValueError(
                    f"passkey seq_len {self.seq_len} is too short for example {index} in the "
                    f"tokens of {self.tokenizer.name}: without filler it takes {len(ids) - 1} "
                    "tokens (task, needle, question and answer); raise seq_len."
                )
            bytes_per_token = len(text.encode()) / len(ids)
            length = max(shortest, length - max(1, int(excess * bytes_per_token)))


@dataclass(frozen=True)
class MQARExample:
    """One MQAR sequence: ``(seq_len + 1,)`` tokens, the queried positions and their answers."""

    tokens: np.ndarray
    query_positions: np.ndarray
    answers: np.ndarray


def _check_mqar_args(seq_len: int, num_kv_pairs: int, num_queries: int, vocab_size: int) -> None:
    for name, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                        ("num_queries", num_queries), ("vocab_size", vocab_size)):
        check_positive_int(name, value)
    num_keys = (vocab_size - 1) // 2
    if num_kv_pairs > num_keys:
        raise ValueError(
            f"num_kv_pairs={num_kv_pairs} needs that many distinct keys but vocab_size="
            f"{vocab_size} has {num_keys}; raise vocab_size or lower num_kv_pairs."
        )
    if num_queries > num_kv_pairs:
        raise ValueError(
            f"num_queries={num_queries} exceeds num_kv_pairs={num_kv_pairs}; each query asks "
            "a different key."
        )
    slots = (seq_len + 1 - 2 * num_kv_pairs) // 2
    if num_queries > slots:
        raise ValueError(
            f"seq_len={seq_len} leaves {max(slots, 0)} query slots after {num_kv_pairs} pairs "
            f"but num_queries={num_queries}; raise seq_len to at least "
            f"{2 * (num_kv_pairs + num_queries) - 1}."
        )


def make_mqar_example(
    rng: np.random.Generator, seq_len: int, num_kv_pairs: int, num_queries: int, vocab_size: int
) -> MQARExample:
    """An MQAR sequence of ``seq_len + 1`` tokens (layout in the module docstring)."""
    _check_mqar_args(seq_len, num_kv_pairs, num_queries, vocab_size)
    key_end = 1 + (vocab_size - 1) // 2
    keys = rng.choice(np.arange(1, key_end), size=num_kv_pairs, replace=False)
    values = rng.integers(key_end, vocab_size, size=num_kv_pairs)
    tokens = np.full(seq_len + 1, MQAR_FILLER_ID, dtype=np.int64)
    tokens[0:2 * num_kv_pairs:2], tokens[1:2 * num_kv_pairs:2] = keys, values
    asked = rng.choice(num_kv_pairs, size=num_queries, replace=False)
    slots = np.sort(rng.choice((seq_len + 1) // 2 - num_kv_pairs, size=num_queries, replace=False))
    positions = 2 * num_kv_pairs + 2 * slots
    tokens[positions], tokens[positions + 1] = keys[asked], values[asked]
    return MQARExample(tokens=tokens, query_positions=positions, answers=values[asked])


class MQARDataset(Dataset):
    """Map-style dataset of MQAR samples from ``(seed, split, index)``, labelled only at the
    query positions; ``num_queries`` defaults to ``num_kv_pairs``."""

    def __init__(
        self,
        seq_len: int = 64,
        size: int = 10_000,
        num_kv_pairs: int = 4,
        num_queries: int | None = None,
        vocab_size: int = 256,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        num_queries = num_kv_pairs if num_queries is None else num_queries
        _check_mqar_args(seq_len, num_kv_pairs, num_queries, vocab_size)
        check_non_negative_int("size", size)
        sample_rng(seed, split, 0)  # validates seed and split
        self.seq_len, self.size, self.seed, self.split = seq_len, size, seed, split
        self.num_kv_pairs, self.num_queries, self.vocab_size = num_kv_pairs, num_queries, vocab_size

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> MQARExample:
        """The sequence behind sample ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a dataset of {self.size}.")
        return make_mqar_example(
            sample_rng(self.seed, self.split, index),
            self.seq_len, self.num_kv_pairs, self.num_queries, self.vocab_size,
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.example(index)
        labelled = np.zeros(self.seq_len, dtype=bool)
        labelled[example.query_positions] = True
        return shifted_sample(example.tokens, labelled)
