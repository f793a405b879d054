"""argparse pieces of ``longnet eval|import|export`` (and the lab's scripts):
:class:`CommandParser` and argparse types whose errors name the value and what was expected."""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from longnet.eval.reporting import parse_length

T = TypeVar("T")


class CommandParser(argparse.ArgumentParser):
    """argparse whose bad argument ends in one line naming it and the reason (exit status 2),
    not the usage summary; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message.rstrip('.')}; see {self.prog} --help.\n")


def argument_type(parse: Callable[[str], T], expected: str | None = None) -> Callable[[str], T]:
    """An argparse type: ``parse(text)``, whose ``ValueError`` becomes the parser's one-line
    error: ``expected <expected>, got '<text>'.``, or without ``expected`` its own message."""

    @functools.wraps(parse)
    def checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                str(err) if expected is None else f"expected {expected}, got {text!r}.") from None

    return checked


def int_between(minimum: int, maximum: float = math.inf) -> Callable[[str], int]:
    """Parse an integer in ``[minimum, maximum]`` (``ValueError`` otherwise)."""

    def parse(text: str) -> int:
        if not minimum <= int(text) <= maximum:
            raise ValueError(text)
        return int(text)

    return parse


positive_int_argument = argument_type(int_between(1), "a positive integer")
non_negative_int_argument = argument_type(int_between(0), "an integer >= 0")
length_argument = argument_type(parse_length)
"""Lengths like ``2048``, ``16K``, ``1M``."""
position_argument = argument_type(functools.partial(parse_length, minimum=0))
"""Positions in a document: ``0``, ``512``, ``16K``."""


@functools.partial(argument_type, expected="a path")
def path_argument(text: str) -> Path:
    """Files and folders: any path but an empty one (which would mean the current folder)."""
    if not text.strip():
        raise ValueError(text)
    return Path(text)


def float_argument(
    minimum: float, maximum: float = math.inf, *, exclusive: bool = False
) -> Callable[[str], float]:
    """A finite number in ``[minimum, maximum]`` (``(minimum, maximum)`` when ``exclusive``)."""
    if math.isinf(maximum):
        bounds = f"{'>' if exclusive else '>='} {minimum:g}"
    else:
        opening, closing = "()" if exclusive else "[]"
        bounds = f"in {opening}{minimum:g}, {maximum:g}{closing}"

    def parse(text: str) -> float:
        value = float(text)
        inside = minimum < value < maximum if exclusive else minimum <= value <= maximum
        if not (math.isfinite(value) and inside):
            raise ValueError(text)
        return value

    return argument_type(parse, f"a finite number {bounds}")


@argument_type
def stride_argument(text: str) -> int | float:
    """A token count (``512``, ``1K``) or a fraction of the context (``0.5``)."""
    if "." not in text:
        return parse_length(text)
    if not 0.0 < float(text) <= 1.0:
        raise ValueError(f"a fractional stride must be in (0, 1], got {text!r}.")
    return float(text)


@argument_type
def device_argument(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:1`` or ``mps``, one this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{text!r} is not a device; write cpu, cuda, cuda:1 or mps.")
    visible = torch.cuda.device_count()
    if device.type == "cuda" and (device.index or 0) >= visible:
        raise ValueError(
            f"{text}: this machine has {visible} visible CUDA device(s); use "
            f"{'--device cpu' if not visible else f'cuda:0 to cuda:{visible - 1}'}.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{text}: MPS is not available here; use --device cpu.")
    return text


@argument_type
def json_object_argument(text: str) -> dict[str, Any]:
    """A JSON object (config overrides)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{text!r} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{text!r} is not a JSON object; write overrides as {{\"name\": value, ...}}")
    return value
