"""Argument checks shared by every layer, each written once, and :class:`UsageError`.

Import-free (like :mod:`longnet.constants`), so every layer from ``longnet.attention`` to
``longnet.eval`` may use it. The messages name the argument and its ``repr``.
"""

from __future__ import annotations

import numbers
from typing import Any


class UsageError(ValueError):
    """A value, file or setting the user can fix, found while the work runs (data that cannot
    be used, a run folder in use, a layout the devices cannot hold, ...).

    The message names the offending value or file and the fix. The ``longnet`` command prints
    it and exits with status 2, without a traceback (``--verbose`` shows it); any other
    exception keeps its traceback. A ``ValueError``, so callers that catch those still do.
    """


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (an ``int``, a NumPy integer such as ``np.int64(8)``:
    any ``numbers.Integral``) and not a ``bool`` (``True`` is an ``int`` in Python, but never
    a valid count, length or index here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (an ``int``, a ``float``, a NumPy number such as
    ``np.float32(0.5)``: any ``numbers.Real``) and not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (:func:`is_int`), else ``ValueError``:
    ``"<name> must be a positive integer, got <value!r>."``"""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (:func:`is_int`), else ``ValueError``:
    ``"<name> must be a non-negative integer, got <value!r>."``"""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
    return int(value)
