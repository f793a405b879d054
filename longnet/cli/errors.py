"""Expected failures of the ``longnet`` command (:data:`EXPECTED_ERRORS`, jsonargparse errors,
bad config files) as the few lines it prints."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException

from longnet.files import refused_write, refused_write_line
from longnet.validation import VERBOSE_HINT, UsageError


class ConfigError(Exception):
    """A run's configuration cannot be instantiated (raised before any work)."""


EXPECTED_ERRORS = (ConfigError, UsageError, MisconfigurationException)
"""Reported in a few lines with exit status 2; anything else keeps its traceback."""
UNION_ERROR = "Does not validate against any of the Union subtypes"
"""How jsonargparse starts the error of a value none of a union's types takes."""


def undecodable_config(args: Sequence[str], err: UnicodeDecodeError) -> str:
    """The message for a file given on the command line that is not UTF-8 text (a config)."""
    for arg in args:
        for candidate in (arg, arg.partition("=")[2]):
            path = Path(candidate)
            if candidate and path.is_file():
                try:
                    path.read_text(encoding="utf-8")
                except UnicodeDecodeError as bad:
                    return (f"{path} is not a text config file ({bad.reason} at byte "
                            f"{bad.start}): give a YAML or JSON config, e.g. "
                            "configs/smoke.yaml.")
    return f"a file given on the command line is not UTF-8 text ({err}); configs are YAML."


def bad_config_file(args: Sequence[str]) -> str | None:
    """The message for a ``--config`` (file or inline YAML) that is not valid YAML, is empty or
    is not a mapping; None if every one is a mapping."""
    values = [arg.partition("=")[2] if arg.startswith("--config=") else args[i + 1]
              for i, arg in enumerate(args)
              if arg.startswith("--config=") or (arg == "--config" and i + 1 < len(args))]
    for value in values:
        path = Path(value)
        named = str(path) if path.is_file() else f"--config {value!r}"
        try:
            content = yaml.safe_load(path.read_text(errors="replace") if path.is_file()
                                     else value)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err)
            return (f"{named} is not valid YAML: {problem}{where}. Fix it there (configs are "
                    "YAML mappings of sections, e.g. configs/smoke.yaml).")
        except OSError:
            continue
        if not isinstance(content, dict):
            holds = "is empty" if content is None else f"holds a {type(content).__name__}"
            return (f"{named} {holds}, not a config: a config is a YAML mapping of sections "
                    "(seed_everything:, trainer:, model:, data:), e.g. configs/smoke.yaml.")
    return None


def parse_error_message(message: str) -> str:
    """jsonargparse's error shortened to ``--key: reason`` (the innermost failing key, without
    the alternatives that do not apply)."""
    lines = [(len(line) - len(line.lstrip()), line.strip()) for line in message.splitlines()
             if line.strip()]
    if not lines:
        return message
    keys, reason = _explain(lines)
    return f"--{'.'.join(keys)}: {reason}" if keys else reason


def _items(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split a ``- item`` list (with indented continuations) into items, dashes removed."""
    items: list[list[tuple[int, str]]] = []
    indent = lines[0][0] if lines else 0
    for level, text in lines:
        if level == indent and text.startswith("- "):
            items.append([(level + 2, text[2:])])
        elif items:  # a continuation at the dash's indent belongs to the item's own block
            items[-1].append((level + 2 if level == indent else level, text))
    return items


def _explain(lines: list[tuple[int, str]]) -> tuple[list[str], str]:
    """(keys, reason) of one error block."""
    text = lines[0][1]
    if match := re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', text):
        rest = [(lines[0][0] + 2, match.group(2))] if match.group(2) else []
        inner = rest + lines[1:]
        keys, reason = _explain(inner) if inner else ([], "invalid value")
        return [match.group(1), *keys], reason
    if text.startswith("- "):  # alternatives at this level (e.g. a path or a class)
        return _best(_items(lines), given=None)
    if text.startswith(UNION_ERROR):
        level = lines[0][0]  # of this block's own lines ("Errors:", "Given value: ...")
        own = [i for i, (at, _) in enumerate(lines) if at == level]
        errors = next((i for i in own if lines[i][1] == "Errors:"), len(lines))
        end = next((i for i in own if i > errors and lines[i][1].startswith("Given value")),
                   len(lines))
        given = next((lines[i][1].removeprefix("Given value: ") for i in own
                      if lines[i][1].startswith("Given value: ")), None)
        return _best(_items(lines[errors + 1:end]), given)
    if match := re.fullmatch(r"Problem with given class_path '([^']+)':", text):
        keys, reason = _explain(lines[1:]) if len(lines) > 1 else ([], text)
        if keys:
            return ["init_args", *keys], reason
        return [], _with_suggestion(reason, match.group(1))
    return [], " ".join(t for _, t in lines)


def _best(items: list[list[tuple[int, str]]], given: str | None) -> tuple[list[str], str]:
    """The reason among a union's alternatives: a class's own error first, else the types."""
    items = [item for item in items if item[0][1] != "Expected a <class 'NoneType'>"]
    for prefix in ("Problem with given class_path", "Does not validate against any"):
        for item in items:
            if item[0][1].startswith(prefix):
                return _explain(item)
    expected = [item[0][1].removeprefix("Expected a ") for item in items
                if item[0][1].startswith("Expected a ")]
    if expected and given is not None and len(expected) == len(items):
        return [], f"{given!r} is not {_one_of(expected)}"
    own = [item for item in items if not item[0][1].startswith("Expected a ")]
    if own or items:  # a class's own refusal says more than the types it was not
        return _explain((own or items)[0])
    return [], f"invalid value {given!r}"


def _one_of(types: list[str]) -> str:
    """``one of 64, 32, 'bf16-mixed'`` / ``an int`` from jsonargparse's type names."""
    literals, others = [], []
    for name in types:
        if name.startswith("typing.Literal[") and name.endswith("]"):
            literals.append(name[len("typing.Literal["):-1])
        else:
            others.append(re.sub(r"<class '([\w.]+)'>", r"\1", name))
    parts = ([f"one of {', '.join(literals)}"] if literals else []) + [f"a {o}" for o in others]
    return " or ".join(parts)


def _with_suggestion(reason: str, class_path: str) -> str:
    """``Option 'x' is not accepted`` of ``class_path``, with the closest accepted names."""
    match = re.fullmatch(r"Option '([^']+)' is not accepted", reason)
    if match is None:
        return f"{reason} ({class_path})"
    module, _, name = class_path.rpartition(".")
    try:
        accepted = list(inspect.signature(getattr(importlib.import_module(module), name))
                        .parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        accepted = []
    close = difflib.get_close_matches(match.group(1), accepted, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"{class_path} has no option {match.group(1)!r}{hint}"


def error_message(err: BaseException) -> str:
    """The lines ``main`` prints for an expected error or a refused write."""
    if refused_write(err):
        what = refused_write_line(err, " (a fit with --ckpt_path last continues from its last "
                                       "complete checkpoint)")
    elif isinstance(err, ConfigError):
        what = f"configuration error: {err}"
    elif isinstance(err, MisconfigurationException):
        what = f"Lightning refused the settings: {err}"
    else:
        what = f"error: {err}"
    return f"longnet: {what}\n{VERBOSE_HINT}"
