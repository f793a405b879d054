"""Argument checks shared by every layer, and :class:`UsageError`; import-free."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any


class UsageError(ValueError):
    """A value, file or setting the user can fix; printed without a traceback (exit 2)."""


VERBOSE_FLAG = "--verbose"
"""The flag that makes the ``longnet`` command and the scripts print tracebacks."""
VERBOSE_HINT = f"(run again with {VERBOSE_FLAG} to see the traceback)"


def is_int(value: Any) -> bool:
    """Whether ``value`` is a ``numbers.Integral`` (NumPy ones too) and not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a ``numbers.Real`` (NumPy ones too) and not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (:func:`is_int`), else ``ValueError``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {describe(value)}.")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (:func:`is_int`), else ``ValueError``."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {describe(value)}.")
    return int(value)


def describe(value: Any) -> str:
    """``repr(value)``, after its type's name where the repr hides it (``Tensor tensor(0.3)``)."""
    if value is None or isinstance(value, (bool, numbers.Number, str, bytes)):
        return repr(value)
    return f"{type(value).__name__} {value!r}"


def check_number(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a real number (:func:`is_real`), else ``ValueError``."""
    if not is_real(value):
        convert = "; pass x.item() for a one-element tensor or array" if hasattr(
            value, "item") else ""
        raise ValueError(
            f"{name} must be a number (an int or a float), not a {type(value).__name__}: got "
            f"{value!r}{convert}."
        )
    return float(value)


def check_positive_float(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a finite number > 0, else ``ValueError``."""
    number = check_number(name, value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}.")
    return number


def check_dropout(name: str, value: Any) -> float:
    """``value`` as a ``float`` if it is a number in ``[0, 1)``, else ``ValueError``."""
    if not is_real(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {describe(value)}.")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError`` (``"no"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}.")
    return value


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {describe(value)}.")
    return value
