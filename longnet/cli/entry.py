"""The ``longnet`` command's entry point (:func:`main`) and its table of argparse subcommands
(:data:`COMMANDS`); ``fit|validate|test|predict`` run :class:`LongNetCLI`."""

from __future__ import annotations

import argparse
import contextvars
import inspect
import logging
import signal
import sys
import traceback
import warnings
from collections.abc import Sequence

from jsonargparse import ArgumentError
from lightning.pytorch.utilities.exceptions import SIGTERMException

from longnet.cli import eval as evaluate
from longnet.cli import pretrained
from longnet.cli.arguments import CommandParser
from longnet.cli.command import LongNetCLI
from longnet.cli.errors import (
    EXPECTED_ERRORS,
    error_message,
    parse_error_message,
)
from longnet.denormals import denormals_kept, flushing_denormals
from longnet.files import refused_write, refused_write_line
from longnet.training.trainer import (
    RERUN_HINT,
    Interrupted,
    exit_status,
    raising_on_signals,
    signal_name,
)
from longnet.validation import VERBOSE_FLAG, VERBOSE_HINT

USAGE_EXIT = 2
SUBCOMMANDS = ("fit", "validate", "test", "predict")
"""Lightning's subcommands (:class:`LongNetCLI`); :data:`COMMANDS` has the others."""
COMMANDS = {
    "eval": {
        "perplexity": (evaluate.perplexity_arguments, evaluate.perplexity),
        "passkey": (evaluate.passkey_arguments, evaluate.passkey),
        "harness": (evaluate.harness_arguments, evaluate.harness),
    },
    "import": (pretrained.import_arguments, pretrained.import_model),
    "export": (pretrained.export_arguments, pretrained.export_model),
}
"""The argparse subcommands: name -> (add its arguments, run it), or a table of its own."""


def command_parser() -> argparse.ArgumentParser:
    """The parser of :data:`COMMANDS` (its help lists Lightning's too); ``args.run`` runs one."""
    parser = CommandParser(prog="longnet", description="LongNet dilated-attention LMs: train, "
                           f"evaluate, import, export. {VERBOSE_FLAG} (anywhere): show the "
                           "traceback of an error.")
    subcommands = parser.add_subparsers(title="subcommands", required=True)
    for name in SUBCOMMANDS:
        subcommands.add_parser(name, help=f"Lightning's {name} (longnet {name} --help)")

    def add(subcommands: argparse._SubParsersAction, table: dict) -> None:
        for name, entry in table.items():
            if isinstance(entry, dict):
                group = subcommands.add_parser(name, help=f"{name} {'|'.join(entry)}")
                add(group.add_subparsers(title="subcommands", required=True), entry)
                continue
            arguments, run = entry
            doc = inspect.cleandoc(run.__doc__)
            command = subcommands.add_parser(name, help=doc.splitlines()[0], description=doc,
                                             formatter_class=argparse.RawDescriptionHelpFormatter)
            arguments(command)
            command.set_defaults(run=run)

    add(subcommands, COMMANDS)
    return parser


def run_command(argv: list[str], verbose: bool) -> int:
    """Run an argparse subcommand; a bad argument, ``ValueError``, ``FileNotFoundError`` or a
    refused write end in a short message and exit status 2."""
    try:
        args = command_parser().parse_args(argv)
    except SystemExit as stop:  # --help, or a bad argument (its line printed)
        return stop.code or 0
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        if isinstance(err, OSError) and not (isinstance(err, FileNotFoundError)
                                             or refused_write(err)):
            raise
        if verbose:
            traceback.print_exc()
        line = refused_write_line(err) if refused_write(err) else f"error: {err}"
        print(f"longnet: {line}\n{VERBOSE_HINT}", file=sys.stderr)
        return USAGE_EXIT


def run_cli(args: Sequence[str] | None = None) -> LongNetCLI:
    """Run the CLI in-process and return it (``cli.trainer``, ``cli.model``, ...)."""
    return LongNetCLI(args=args)


class _NoTips(logging.Filter):
    """Drop Lightning's advertisement tips ("💡 Tip: ... litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def quiet_lightning() -> None:
    """Silence Lightning's tips and the warnings a user cannot act on (its pytree deprecation,
    a resumed run's non-empty checkpoint folder)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # only a resumed fit gets there: run_folder refuses another run's checkpoints
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status: 0; 2 for an expected error (parser
    errors, :data:`EXPECTED_ERRORS`, a refused write), reported without a traceback unless
    ``--verbose``; ``128 + signal`` for a run stopped by SIGTERM or SIGINT."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = VERBOSE_FLAG in argv
    argv = [arg for arg in argv if arg != VERBOSE_FLAG]
    if not argv or argv[0] in ("-h", "--help", *COMMANDS):
        return run_command(argv, verbose)
    if args is None:
        sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and warns if given args too)
    quiet_lightning()
    # first thing, before any parallel torch operation (longnet.denormals)
    with flushing_denormals(not denormals_kept()), raising_on_signals():
        try:
            run_in_own_context(None if args is None else argv)
        except ArgumentError as err:
            subcommand = next((arg for arg in argv if arg in SUBCOMMANDS), None)
            help_command = " ".join(filter(None, ["longnet", subcommand, "--help"]))
            shown = str(err) if verbose else parse_error_message(str(err))
            print(f"longnet: error: {shown}\n(run {help_command} for the options"
                  + ("" if verbose else f"; add {VERBOSE_FLAG} for the parser's whole message")
                  + ")", file=sys.stderr)
            return USAGE_EXIT
        except (*EXPECTED_ERRORS, OSError) as err:
            if isinstance(err, OSError) and not refused_write(err):
                raise  # a bug or an unexpected fault: its traceback
            if verbose:
                traceback.print_exc()
            sys.stderr.write(error_message(err) + "\n")  # one write: ranks do not interleave
            sys.stderr.flush()
            return USAGE_EXIT
        except SIGTERMException as stop:  # StopOnSignal said where it stopped
            code = stop.code
            return code if isinstance(code, int) and code else exit_status(signal.SIGTERM)
        except Interrupted as err:
            print(f"longnet: interrupted by {signal_name(err.signum)}. {RERUN_HINT}",
                  file=sys.stderr)
            return exit_status(err.signum)
    return 0


def run_in_own_context(args: Sequence[str] | None) -> None:
    """Run the CLI in a copy of the context, dropped on return: jsonargparse's context variable
    would otherwise keep the process groups alive past their exit hook, and gloo can abort at
    interpreter shutdown (docs/training.md, "A lost rank")."""
    contextvars.copy_context().run(run_cli, args)
