"""The sample interface every dataset of this package returns.

A sample is ``{"input_ids": LongTensor (seq_len,), "labels": LongTensor (seq_len,)}`` with the
labels already shifted: ``labels[t]`` is the token at position ``t + 1`` of the underlying
``seq_len + 1`` tokens, or ``IGNORE_INDEX`` where no loss is taken (padding, or positions that
are not answers in a task that labels only its answers).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100


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
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    labels = tokens[1:].clone()
    if labelled is not None:
        labels[~torch.as_tensor(np.asarray(labelled), dtype=torch.bool)] = IGNORE_INDEX
    return {"input_ids": tokens[:-1].clone(), "labels": labels}
