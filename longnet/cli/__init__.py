"""The ``longnet`` command: ``longnet fit|validate|test|predict --config configs/X.yaml``
(Lightning's CLI), ``longnet eval perplexity|passkey|harness``, ``longnet import``,
``longnet export``.

:func:`main` is the console entry point (also ``python -m longnet``) and returns the exit
status; :class:`LongNetCLI` is the LightningCLI it runs (``LongNetCLI(args=[...])`` runs the
command in-process and keeps ``.trainer``, ``.model``, ``.datamodule``). What the command adds
to Lightning's CLI: docs/training.md, "The command".

Modules: ``command`` (:class:`LongNetCLI`, :class:`~longnet.cli.command.RunConfigSaver`),
``entry`` (:func:`main`, the table of subcommands), ``run_checks`` (the checks of a run folder
and its checkpoints), ``errors`` (expected failures as a few lines on stderr), ``eval`` and
``pretrained`` (the argparse subcommands), ``arguments`` (their argparse types).
"""

from longnet.cli.command import LongNetCLI
from longnet.cli.entry import main

__all__ = ["LongNetCLI", "main"]
