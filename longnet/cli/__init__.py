"""The ``longnet`` command: ``longnet fit|validate|test|predict --config configs/X.yaml``.

Its modules, one job each:

- ``command``: :class:`LongNetCLI` (the LightningCLI over ``CausalLMModule`` and any
  datamodule; its docstring lists what the command adds to Lightning's) and
  :class:`RunConfigSaver`;
- ``runs``: the checks of a run folder and its checkpoints, and what a run left in it;
- ``errors``: expected failures and parser errors as a few lines on stderr;
- ``entry``: :func:`main` (the console entry point; ``python -m longnet``), :func:`run_cli`.
"""

from longnet.cli.command import LongNetCLI, RunConfigSaver
from longnet.cli.entry import (
    SUBCOMMANDS,
    USAGE_EXIT,
    main,
    quiet_lightning,
    run_cli,
    run_in_own_context,
)
from longnet.cli.errors import (
    EXPECTED_ERRORS,
    VERBOSE_FLAG,
    ConfigError,
    error_message,
    parse_error_message,
    undecodable_config,
)
from longnet.cli.runs import (
    RUN_FILES,
    check_batches_to_run,
    check_checkpoint_shape,
    check_default_root_dir,
    check_keyword,
    check_outputs,
    check_overfit_batches,
    check_steps_left,
    check_trained_weights,
    checkpoints_hint,
    config_difference,
    describe_run,
    last_good_checkpoint,
    max_time_cut,
    refuse_earlier_run,
    run_last_checkpoint,
)

__all__ = [
    "EXPECTED_ERRORS",
    "RUN_FILES",
    "SUBCOMMANDS",
    "USAGE_EXIT",
    "VERBOSE_FLAG",
    "ConfigError",
    "LongNetCLI",
    "RunConfigSaver",
    "check_batches_to_run",
    "check_checkpoint_shape",
    "check_default_root_dir",
    "check_keyword",
    "check_outputs",
    "check_overfit_batches",
    "check_steps_left",
    "check_trained_weights",
    "checkpoints_hint",
    "config_difference",
    "describe_run",
    "error_message",
    "last_good_checkpoint",
    "main",
    "max_time_cut",
    "parse_error_message",
    "quiet_lightning",
    "refuse_earlier_run",
    "run_cli",
    "run_in_own_context",
    "run_last_checkpoint",
    "undecodable_config",
]
