"""The sample interface every dataset of this package returns.

A sample is ``{"input_ids": LongTensor (seq_len,), "labels": LongTensor (seq_len,)}`` with the
labels already shifted: ``labels[t]`` is the token at position ``t + 1`` of the underlying
``seq_len + 1`` tokens, or ``IGNORE_INDEX`` where no loss is taken (padding, or positions that
are not answers in a task that labels only its answers).
"""

from __future__ import annotations

import numpy as np
import torch

from longnet.constants import IGNORE_INDEX
from longnet.data.splits import SPLITS
from longnet.validation import check_non_negative_int

SPLIT_STREAMS = {split: stream for stream, split in enumerate(SPLITS)}


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The random generator of sample ``index`` of a synthetic ``split`` under ``seed``.

    Seeded by ``(seed, split, index)`` through ``numpy.random.SeedSequence``, so any sample can
    be regenerated alone (map-style datasets, any sampler, any worker), the three splits of one
    seed are independent streams, and different seeds give different samples.
    """
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {sorted(SPLIT_STREAMS)}, got {split!r}.")
    check_non_negative_int("seed", seed)
    return np.random.default_rng([seed, SPLIT_STREAMS[split], index])


def shifted_sample(
    tokens: np.ndarray, labelled: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """Cut ``seq_len + 1`` tokens into a shifted sample.

    Args:
        tokens: ``(seq_len + 1,)`` integer token ids.
        labelled: optional ``(seq_len,)`` bool mask over label positions; ``labels[t]`` keeps
            ``tokens[t + 1]`` where it is True and is ``IGNORE_INDEX`` elsewhere. ``None``
            labels every position.

    Returns:
        ``{"input_ids": (seq_len,), "labels": (seq_len,)}``, both int64.
    """
    tokens = torch.tensor(np.asarray(tokens), dtype=torch.long)
    labels = tokens[1:].clone()
    if labelled is not None:
        labels[~torch.tensor(np.asarray(labelled), dtype=torch.bool)] = IGNORE_INDEX
    return {"input_ids": tokens[:-1], "labels": labels}
