"""The lab scripts' parser and runner: :class:`ScriptParser` (``longnet``'s
:class:`~longnet.cli.arguments.CommandParser`, a bad argument in one line, plus ``--verbose``)
and :func:`run_cli` (an expected error in two lines, exit status 2). Their argparse types come
from :mod:`longnet.cli.arguments`."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

from longnet.cli.arguments import CommandParser
from longnet.files import refused_write, refused_write_line
from longnet.validation import VERBOSE_FLAG, VERBOSE_HINT


class ScriptParser(CommandParser):
    """A :class:`CommandParser` that accepts ``--verbose``, before or after a subcommand
    (:func:`run_cli` reads it)."""

    verbose = False
    """Whether the command line parsed last gave ``--verbose``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(VERBOSE_FLAG, action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show its traceback too")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        ScriptParser.verbose = getattr(namespace, "verbose", False)
        return namespace, extras


def run_cli(main: Callable[[], int]) -> int:
    """Run a script's ``main``; bad arguments or inputs (``ValueError``, ``FileNotFoundError``)
    and a write the machine refused (``longnet.files.refused_write``: no room, a read-only file
    system) end as the ``longnet`` command ends them: their message, a line naming
    ``--verbose`` (given to a :class:`ScriptParser`, it prints the traceback too) and exit
    status 2. Any other error keeps its traceback."""
    try:
        return main()
    except (ValueError, OSError) as err:
        if isinstance(err, OSError) and not (isinstance(err, FileNotFoundError)
                                             or refused_write(err)):
            raise
        if ScriptParser.verbose:
            traceback.print_exc()
        line = refused_write_line(err) if refused_write(err) else f"error: {err}"
        print(f"{line}\n{VERBOSE_HINT}", file=sys.stderr)
        return 2
