"""Deterministic train/validation/test assignment of documents by a hash of their content.

A document's split depends only on its bytes and the two fractions: the 64-bit BLAKE2b digest
of its content, read as a number ``u`` in ``[0, 1)``, puts it in ``validation`` when
``u < val_fraction``, in ``test`` when ``u < val_fraction + test_fraction``, else in ``train``.
So splits are the same on every machine and every build, identical documents always share a
split (no train/eval leakage through duplicates), and raising ``test_fraction`` never moves a
validation document.
"""

from __future__ import annotations

import hashlib

import numpy as np

from longnet.validation import is_real

SPLITS = ("train", "validation", "test")


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raise ``ValueError`` unless both fractions are in (0, 1) and leave room for training."""
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not is_real(value) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {value!r}.")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"val_fraction + test_fraction must be < 1 so documents remain for training, got "
            f"{val_fraction} + {test_fraction}; lower them."
        )


def document_hash(tokens: np.ndarray) -> str:
    """16 hex digits of the BLAKE2b-64 digest of a document's ``(n,)`` uint8 tokens."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.uint8), digest_size=8).hexdigest()


def split_of(doc_hash: str, val_fraction: float, test_fraction: float) -> str:
    """The split (``"train"``, ``"validation"`` or ``"test"``) of a document by its hash."""
    u = int(doc_hash, 16) / 2.0**64
    if u < val_fraction:
        return "validation"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"
