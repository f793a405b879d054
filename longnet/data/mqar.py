"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology").

A sample of ``seq_len + 1`` tokens is ``num_kv_pairs`` key-value pairs followed by a query
region. Keys are distinct ids from ``[1, 1 + (vocab_size - 1) // 2)``, values are ids from the
rest of the vocabulary (repeats allowed), ``0`` is filler. The query region is cut into
two-token slots; ``num_queries`` distinct keys are asked in random slots as ``key value`` and
the other slots are filler. Only the positions holding a queried key are labelled: their label
is the value that follows, which the model can only know by recalling the pair::

    k3 v3 k1 v1 k2 v2 | 0 0 k1 v1 0 0 0 0 k3 v3 0 0 ...
                           ^ label v1        ^ label v3
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from longnet.data.samples import sample_rng, shifted_sample
from longnet.validation import check_non_negative_int, check_positive_int

FILLER_ID = 0


@dataclass(frozen=True)
class MQARExample:
    """One MQAR sequence.

    Attributes:
        tokens: ``(seq_len + 1,)`` int64 token ids.
        query_positions: ``(num_queries,)`` input positions holding a queried key, ascending.
        answers: ``(num_queries,)`` the value each of those positions must predict.
    """

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
    tokens = np.full(seq_len + 1, FILLER_ID, dtype=np.int64)
    tokens[0:2 * num_kv_pairs:2], tokens[1:2 * num_kv_pairs:2] = keys, values
    asked = rng.choice(num_kv_pairs, size=num_queries, replace=False)
    slots = np.sort(rng.choice((seq_len + 1) // 2 - num_kv_pairs, size=num_queries, replace=False))
    positions = 2 * num_kv_pairs + 2 * slots
    tokens[positions], tokens[positions + 1] = keys[asked], values[asked]
    return MQARExample(tokens=tokens, query_positions=positions, answers=values[asked])


class MQARDataset(Dataset):
    """Map-style dataset of MQAR samples, each generated from ``(seed, split, index)``.

    A sample is ``{"input_ids": (seq_len,), "labels": (seq_len,)}`` (int64) with labels only on
    the ``num_queries`` query positions (``IGNORE_INDEX`` elsewhere). ``num_queries`` defaults
    to ``num_kv_pairs`` (every key asked once).
    """

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
