"""What the code says about itself: every module docstring of ``longnet/`` and ``lab/``
says what the module is, never its history (no issue references such as ``issue 12`` or
``#12``, no "used to" or "no longer"; stories go to lab/notes/ or the CHANGELOG), and
``longnet.cli`` exports the command and its class only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted([*(REPO / "longnet").rglob("*.py"), *(REPO / "lab").rglob("*.py")])

HISTORY = re.compile(
    r"\bissues?\s+#?\d+"  # issue 12, issues 3 and 4, issue #12
    r"|(?<![\w&/])#\d+\b"  # #12 (not an HTML entity &#12; or a URL fragment)
    r"|\bused to\b"
    r"|\bno longer\b",
    re.IGNORECASE,
)


def history_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of the module docstring of ``source`` that reads
    as history (:data:`HISTORY`); empty when the module has no docstring."""
    tree = ast.parse(source)
    docstring = ast.get_docstring(tree, clean=False)
    if docstring is None:
        return []
    first = tree.body[0].lineno  # the line of the opening quotes, where the docstring starts
    return [(first + i, line.strip()) for i, line in enumerate(docstring.splitlines())
            if HISTORY.search(line)]


def test_the_modules_are_found():
    names = {str(p.relative_to(REPO)) for p in MODULES}
    assert {"longnet/__init__.py", "longnet/cli/command.py", "lab/scripts/gpu_check.py"} <= names


def test_module_docstrings_say_what_the_module_is_not_its_history():
    found = [f"{path.relative_to(REPO)}:{number}: {line}"
             for path in MODULES
             for number, line in history_lines(path.read_text(encoding="utf-8"))]
    assert found == [], (
        "module docstrings that tell history; say what the module is and does, and move the "
        "story to lab/notes/ or CHANGELOG.md:\n" + "\n".join(found)
    )


@pytest.mark.parametrize("line", [
    "Fixes issue 12: the ring hangs.",
    "See Issues 3 and 4.",
    "the dK/dV accumulator (#17) travels",
    "The loader used to repeat batches after a resume.",
    "A folder is no longer replaced in place.",
])
def test_history_is_found(line):
    source = f'"""The module.\n\n{line}\n"""\n\nx = 1\n'
    assert history_lines(source) == [(3, line)]


@pytest.mark.parametrize("source", [
    '"""The module: a checkpoint is read once; tokens 0..255 are bytes."""\n',
    '"""Escapes such as &#12; and links such as page.md#12 are not issues."""\n',
    'x = 1\n"""Not a module docstring: used to, issue 12."""\n',
    "# issue 12: a comment, not the docstring\nx = 1\n",
])
def test_what_is_not_history_is_not_found(source):
    assert history_lines(source) == []


def test_the_cli_package_exports_the_command_and_its_class():
    """``longnet.cli`` is the command (:func:`main`) and its class (:class:`LongNetCLI`);
    its helpers are imported from their modules (``longnet.cli.run_checks``, ``.errors``,
    ``.entry``, ``.command``)."""
    import longnet.cli
    from longnet.cli.command import LongNetCLI
    from longnet.cli.entry import main

    assert sorted(longnet.cli.__all__) == ["LongNetCLI", "main"]
    assert longnet.cli.main is main and longnet.cli.LongNetCLI is LongNetCLI
    public = {name for name, value in vars(longnet.cli).items()
              if not name.startswith("_") and not isinstance(value, type(longnet.cli))}
    assert public == {"LongNetCLI", "main"}
