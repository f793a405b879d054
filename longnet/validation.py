"""Argument checks shared by every layer, each written once, and :class:`UsageError`.

Import-free (like :mod:`longnet.constants`), so every layer from ``longnet.attention`` to
``longnet.eval`` may use it. The messages name the argument and its ``repr``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any


class UsageError(ValueError):
    """A value, file or setting the user can fix, found while the work runs (data that cannot
    be used, a run folder in use, a layout the devices cannot hold, ...).

    The message names the offending value or file and the fix. The ``longnet`` command prints
    it and exits with status 2, without a traceback (``--verbose`` shows it); any other
    exception keeps its traceback. A ``ValueError``, so callers that catch those still do.
    """


VERBOSE_FLAG = "--verbose"
"""What the ``longnet`` command and the scripts take to print an error's traceback too."""
VERBOSE_HINT = f"(run again with {VERBOSE_FLAG} to see the traceback)"


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
        raise ValueError(f"{name} must be a positive integer, got {describe(value)}.")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (:func:`is_int`), else ``ValueError``:
    ``"<name> must be a non-negative integer, got <value!r>."``"""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {describe(value)}.")
    return int(value)


def describe(value: Any) -> str:
    """``repr(value)`` for a message, after the name of its type where the repr does not show
    it: ``Tensor tensor(0.3000)``, ``ndarray array([1, 2])``, but ``'3'`` and ``2.5``."""
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes)):
        return repr(value)
    return f"{type(value).__name__} {value!r}"


def check_number(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a real number (:func:`is_real`), else ``ValueError``
    naming its type: ``"<name> must be a number (an int or a float), not a <type>: got
    <value!r>"`` (with how to convert a one-element tensor or array)."""
    if not is_real(value):
        convert = "; pass x.item() for a one-element tensor or array" if hasattr(
            value, "item") else ""
        raise ValueError(
            f"{name} must be a number (an int or a float), not a {type(value).__name__}: got "
            f"{value!r}{convert}."
        )
    return float(value)


def check_positive_float(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a finite number > 0, else ``ValueError``:
    ``"<name> must be a finite positive number, got <value!r>."`` (:func:`check_number` for
    a value that is no number)."""
    number = check_number(name, value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}.")
    return number


def check_dropout(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a number in ``[0, 1)`` (a dropout probability), else
    ``ValueError``: ``"<name> must be a number in [0, 1), got <value!r>."``"""
    if not is_real(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {describe(value)}.")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError``: ``"<name> must be True or False, got
    <value!r>."`` (a string such as ``"no"`` is truthy: taken as a flag it would mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}.")
    return value


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError``: ``"<name> must be one of
    [...], got <value!r>."``"""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {describe(value)}.")
    return value
