"""The ``longnet`` command's entry point: :func:`main` runs :class:`LongNetCLI` in its own
context (:func:`run_in_own_context`), with subnormal floats flushed and signals turned into a
clean stop, and turns what it raises into an exit status and a few lines on stderr."""

from __future__ import annotations

import contextvars
import logging
import signal
import sys
import traceback
import warnings
from collections.abc import Sequence

from jsonargparse import ArgumentError
from lightning.pytorch.utilities.exceptions import SIGTERMException

from longnet.cli.command import LongNetCLI
from longnet.cli.errors import (
    EXPECTED_ERRORS,
    error_message,
    parse_error_message,
)
from longnet.denormals import denormals_kept, flushing_denormals
from longnet.files import refused_write
from longnet.training.trainer import (
    RERUN_HINT,
    Interrupted,
    exit_status,
    raising_on_signals,
    signal_name,
)
from longnet.validation import VERBOSE_FLAG

USAGE_EXIT = 2
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def run_cli(args: Sequence[str] | None = None) -> LongNetCLI:
    """Run the CLI in-process and return it (``cli.trainer``, ``cli.model``, ...)."""
    return LongNetCLI(args=args)


class _NoTips(logging.Filter):
    """Drop Lightning's advertisement tips ("💡 Tip: ... litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def quiet_lightning() -> None:
    """No advertisement tips, and none of the warnings every run would print that a user
    cannot act on: the deprecation warning of Lightning's pytree helper with this torch, and
    the non-empty checkpoint folder of a resumed run."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # a resumed fit writes into its own checkpoint folder; a new one never gets there
    # (longnet.training.run_folder refuses a folder with another run's checkpoints)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status: 0; 2 for an expected error
    (:data:`EXPECTED_ERRORS`, parser errors, a full disk or a file size limit, reported in a
    few lines without a traceback unless ``--verbose`` is given); ``128 + signal`` for a run
    stopped by SIGTERM (143) or SIGINT (130)."""
    argv = sys.argv[1:] if args is None else list(args)
    verbose = VERBOSE_FLAG in argv
    argv = [arg for arg in argv if arg != VERBOSE_FLAG]
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
    """Run the CLI in a copy of the context, dropped on return.

    jsonargparse leaves its last subcommand parser in a context variable, and the parser
    reaches the CLI, its trainer, strategy and process groups. Left there, a distributed run's
    process groups would outlive the exit hook that destroys them
    (:func:`~longnet.distributed.strategy.destroy_process_group_at_exit`) and be freed only while
    the interpreter shuts down, where gloo can abort a process whose run finished
    ("terminate called without an active exception"; docs/training.md, "A lost rank")."""
    contextvars.copy_context().run(run_cli, args)
