"""The ``longnet`` command: ``longnet fit|validate|test|predict --config configs/X.yaml``
(Lightning's CLI), ``longnet eval perplexity|passkey|harness``, ``longnet import``,
``longnet export``.

:func:`main` is the console entry point (also ``python -m longnet``) and returns the exit
status; :class:`LongNetCLI` is the LightningCLI it runs (``LongNetCLI(args=[...])`` runs it
in-process and keeps ``.trainer``, ``.model``, ``.datamodule``).
"""

from longnet.cli.command import LongNetCLI
from longnet.cli.entry import main

__all__ = ["LongNetCLI", "main"]
