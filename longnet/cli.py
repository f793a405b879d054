"""The ``longnet`` command: ``longnet fit|validate|test|predict --config configs/X.yaml``.

A :class:`~lightning.pytorch.cli.LightningCLI` over :class:`longnet.training.CausalLMModule`
(or a subclass) and any ``LightningDataModule`` (``class_path``/``init_args`` in YAML), with:

- ``--test_after_fit true``: after ``fit``, ``test`` the best checkpoint in the same process,
  so one command trains, validates, tests and (with ``ExportPretrained``) exports;
- after ``fit``, a list of what the run folder holds (model export, curves, metrics, ...);
- the resolved config saved in the run folder (the logger's ``log_dir``) of every run:
  ``config.yaml`` for ``fit`` (overwritten when a run is resumed), ``config-<stage>.yaml``
  for the other subcommands;
- ``predict`` on a datamodule without a predict split scores its test split (per-sample
  summed cross-entropy, tokens and bits per byte; add ``longnet.training.PredictionsWriter``
  to the callbacks to write them);
- configuration errors (unknown keys, bad values, missing data files, unknown model names)
  reported as one line on stderr with exit code 2, before any work starts.

``longnet --help`` and ``longnet fit --help`` list everything; ``--print_config`` prints the
resolved config.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.model_helpers import is_overridden

from longnet.training import CausalLMModule
from longnet.training.callbacks import run_dir


class ConfigError(Exception):
    """A run's configuration cannot be instantiated (raised before any work)."""


class RunConfigSaver(SaveConfigCallback):
    """Save the resolved config as ``config.yaml`` (fit) or ``config-<stage>.yaml``."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        stage = getattr(stage, "value", stage)  # a TrainerFn or its string value
        self.config_filename = "config.yaml" if stage == "fit" else f"config-{stage}.yaml"
        super().setup(trainer, pl_module, stage)


class LongNetCLI(LightningCLI):
    """LightningCLI for LongNet causal-LM training; see the module docstring."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            CausalLMModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=RunConfigSaver,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"description": "LongNet dilated-attention LMs: train, evaluate."},
            args=list(args) if args is not None else None,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=False,
            help="After fit, test the best checkpoint (or the final weights) in the same "
            "process. Ignored by the other subcommands.",
        )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
            raise ConfigError(f"{type(err).__name__}: {err}") from err

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit") and not self.trainer.interrupted:
            best = getattr(self.trainer.checkpoint_callback, "best_model_path", "") or None
            self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best)
        folder = run_dir(self.trainer)  # on every rank: log_dir is a collective
        if self.trainer.is_global_zero:
            print(describe_run(folder))

    def predict(self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None,
                **kwargs) -> object:
        """``trainer.predict``; a datamodule without a predict split predicts its test split."""
        if datamodule is not None and not is_overridden(
            "predict_dataloader", datamodule, L.LightningDataModule
        ):
            datamodule.prepare_data()
            datamodule.setup("predict")
            return self.trainer.predict(model, dataloaders=datamodule.test_dataloader(), **kwargs)
        return self.trainer.predict(model, datamodule=datamodule, **kwargs)


def describe_run(folder: Path) -> str:
    """Lines naming what a run left in its folder (only the files that exist)."""
    outputs = (
        ("model/", "trained model: LongNetLM.from_pretrained({path!r})"),
        ("curves.png", "training curves (bits per byte vs step)"),
        ("metrics.json", "final validation and test metrics"),
        ("metrics.csv", "every logged value"),
        ("config.yaml", "the resolved config"),
        ("checkpoints/", "Lightning checkpoints (fit --ckpt_path last resumes)"),
    )
    lines = [f"Run folder {folder}:"]
    for name, what in outputs:
        path = folder / name
        if path.exists():
            lines.append(f"  {str(path) + ('/' if path.is_dir() else ''):<40} "
                         f"{what.format(path=str(path))}")
    return "\n".join(lines)


def run_cli(args: Sequence[str] | None = None) -> LongNetCLI:
    """Run the CLI in-process and return it (``cli.trainer``, ``cli.model``, ...)."""
    return LongNetCLI(args=args)


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0, or 2 for a configuration error)."""
    try:
        run_cli(args)
    except ConfigError as err:
        print(f"longnet: configuration error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
