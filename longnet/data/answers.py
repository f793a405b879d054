"""Exact checks of answers on tasks that label only their answer positions (passkey in
``"answer"`` mode, MQAR)."""

from __future__ import annotations

import torch

from longnet.constants import IGNORE_INDEX


def _check(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if predictions.shape != labels.shape:
        raise ValueError(
            f"predictions have shape {tuple(predictions.shape)} but labels "
            f"{tuple(labels.shape)}; pass argmax token ids of shape (batch, seq_len)."
        )
    return labels != IGNORE_INDEX


def answer_accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of labelled positions whose predicted token equals the label.

    Args:
        predictions: ``(batch, seq_len)`` predicted token ids (e.g. ``logits.argmax(-1)``).
        labels: ``(batch, seq_len)`` labels with ``IGNORE_INDEX`` on unscored positions.
    """
    scored = _check(predictions, labels)
    if not scored.any():
        raise ValueError("labels have no scored position (all are IGNORE_INDEX).")
    return (predictions[scored] == labels[scored]).float().mean().item()


def answer_exact_match(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(batch,)`` bools: every labelled position of the sample is predicted exactly.

    Shapes as in ``answer_accuracy``.
    """
    scored = _check(predictions, labels)
    return ((predictions == labels) | ~scored).all(dim=-1)
